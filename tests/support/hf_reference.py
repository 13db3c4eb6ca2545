"""The transformers side of the parity test, run as a separate process (not a test module).

Usage: ``python tests/support/hf_reference.py REQUEST.json OUT_DIR``. The request names
the GGUF, the prompts (token ids) and how many tokens to decode greedily; the
answer is ``OUT_DIR/result.json`` (continuations, smallest top-1 margins, load
time) and ``OUT_DIR/logits.safetensors`` (prefill logits per prompt).

A process of its own because transformers' GGUF loader needs ~30 s on two
cores: the test computes the project's side on one core while this runs on
the other, and transformers' import-time state stays out of the test process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: no hub access, ever

import safetensors.torch
import torch
import transformers


def greedy_batch(
    model: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> tuple[list[list[int]], list[float]]:
    """Greedy decoding of all prompts as one left-padded batch with a KV cache, never stopping at EOS.

    One forward per step for the whole batch (not one per prompt and step): the
    reference costs ~64 forwards instead of ~320. Also returns, per prompt, the
    smallest top-1/top-2 logit margin met along the way (how close a tie came).
    """
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = transformers.DynamicCache(config=model.config)
    out: list[list[int]] = [[] for _ in prompts]
    margins = [float("inf")] * len(prompts)
    for _ in range(new_tokens):
        logits = model(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits[:, -1]
        top2 = logits.topk(2, dim=-1).values
        nxt = logits.argmax(-1)
        for row, token in enumerate(nxt.tolist()):
            out[row].append(int(token))
            margins[row] = min(margins[row], float(top2[row, 0] - top2[row, 1]))
        ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=-1)
        positions = positions[:, -1:] + 1
    return out, margins


def main(request_path: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    request = json.loads(request_path.read_text(encoding="utf-8"))
    gguf = Path(request["gguf"])
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    load_s = time.perf_counter() - start
    with torch.no_grad():
        logits = {
            str(i): model(torch.tensor([ids])).logits[0].contiguous() for i, ids in enumerate(request["logit_prompts"])
        }
        continuations, margins = greedy_batch(
            model, request["greedy_prompts"], request["new_tokens"], int(model.config.pad_token_id or 0)
        )
    safetensors.torch.save_file(logits, str(out_dir / "logits.safetensors"))
    result = {
        "transformers": transformers.__version__,
        "load_s": load_s,
        "total_s": time.perf_counter() - start,
        "cpu_s": time.process_time(),
        "continuations": continuations,
        "margins": margins,
    }
    (out_dir / "result.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: hf_reference.py REQUEST.json OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
