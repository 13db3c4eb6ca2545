"""A real vLLM engine on CPU with n-gram speculative decoding (run as a script by test_plugin_engine.py, not a test).

Prints one line, ``RESULT_PREFIX`` then JSON (vLLM logs to stdout too): this front end's pid, vLLM's version, the generated token count and vLLM's
speculative-decoding counters, so the test can tell that drafts were proposed and verified.
"""

from __future__ import annotations

import json
import os
import sys

RESULT_PREFIX = "specdec-engine-result: "


def main(model_dir: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=128,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    )
    # A repetitive prompt, so the n-gram drafter finds matches and proposes drafts.
    prompt = "one two three four one two three four one two three four one two"
    outputs = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    counters = {
        metric.name: getattr(metric, "value", None)
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode_num_draft")
    }
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "pid": os.getpid(),
                "vllm_version": vllm.__version__,
                "generated_tokens": len(outputs[0].outputs[0].token_ids),
                "spec_decode": counters,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # vLLM on CPU spawns its engine core and worker, which re-import this module
    main(sys.argv[1])
