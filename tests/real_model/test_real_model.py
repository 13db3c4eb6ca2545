"""SmolLM2-135M-Instruct in the project's own Transformer against transformers on the same GGUF.

The reference is transformers' own GGUF loader (its dequantization, its q/k
un-permutation, its Llama), offline, in a separate process (``hf_reference.py``)
so that its ~30 s load runs on one core while the project's side runs on the
other. Agreement is asserted on prefill logits (an fp32 tolerance) and on
64-token greedy continuations through the project's Engine with plain
decoding (identical tokens). Both sides get the same token ids, so a tokenizer
difference can neither hide nor cause a model difference; the tokenizers (and
chat templates) are compared on their own.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch
from real_models import PulledModel, smollm2  # noqa: F401  (fixture)

from contracts import BatchExecutionDescriptor, CUDAGraphMode
from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata, reserve
from specdec.engine import Engine, EngineConfig
from specdec.kv_cache import KVCacheManager
from specdec.scheduler import SchedulerConfig

LOGIT_ATOL = 1e-3
"""fp32 on both sides: differences come only from summation order (paged attention vs SDPA, BLAS blocking).
Logits reach ~25 in magnitude; the largest difference measured is ~1e-4 (docs/models.md)."""

NEW_TOKENS = 64
REFERENCE_TIMEOUT_S = 280
"""Under pytest-timeout's 300 s, so a stuck reference fails with its log rather than a bare timeout."""
PLAIN_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
CHAT_PROMPTS = (
    "What is the boiling point of water at sea level?",
    "Write a haiku about the ocean.",
)
LOGIT_ONLY_PROMPTS = (
    "In 1969, 3 astronauts flew 384,400 km — naïve estimates said it was impossible. 日本語も少し。",
    "Speculative decoding drafts several tokens cheaply and verifies them with one forward of the target model. "
    "Accepted tokens are exactly what the target would have produced, so the output distribution is unchanged, "
    "while the number of expensive sequential forwards drops. The gain depends on how often drafts are accepted.",
)


def greedy_prompts(model: PulledModel) -> list[list[int]]:
    tok = model.tokenizer
    plain = [tok.encode(p) for p in PLAIN_PROMPTS]
    return plain + [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


def logit_prompts(model: PulledModel) -> list[list[int]]:
    return greedy_prompts(model) + [model.tokenizer.encode(p) for p in LOGIT_ONLY_PROMPTS]


# -- the reference process -------------------------------------------------------------------------


@dataclass
class Reference:
    """transformers' results, read once the process has finished."""

    logits: list[torch.Tensor]
    continuations: list[list[int]]
    margins: list[float]
    load_s: float
    total_s: float


class ReferenceProcess:
    def __init__(self, model: PulledModel, work: Path) -> None:
        self.work = work
        request = {
            "gguf": str(model.source_gguf),
            "logit_prompts": logit_prompts(model),
            "greedy_prompts": greedy_prompts(model),
            "new_tokens": NEW_TOKENS,
        }
        (work / "request.json").write_text(json.dumps(request), encoding="utf-8")
        script = Path(__file__).resolve().parents[1] / "support" / "hf_reference.py"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.log = (work / "reference.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(work / "request.json"), str(work)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.started = time.monotonic()
        self._result: Reference | None = None

    def result(self) -> Reference:
        if self._result is None:
            try:
                code = self.proc.wait(timeout=max(1.0, REFERENCE_TIMEOUT_S - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                self.stop()
                log = (self.work / "reference.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"the transformers reference took over {REFERENCE_TIMEOUT_S} s:\n{log}", pytrace=False)
            self.log.close()
            if code != 0:
                log = (self.work / "reference.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"the transformers reference process failed (exit {code}):\n{log}", pytrace=False)
            data = json.loads((self.work / "result.json").read_text(encoding="utf-8"))
            logits = safetensors.torch.load_file(str(self.work / "logits.safetensors"))
            self._result = Reference(
                [logits[str(i)] for i in range(len(logits))],
                data["continuations"],
                data["margins"],
                data["load_s"],
                data["total_s"],
            )
            print(
                f"\ntransformers {data['transformers']}: GGUF load {data['load_s']:.1f} s, "
                f"all {data['total_s']:.1f} s wall, {data['cpu_s']:.1f} s CPU"
            )
        return self._result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def reference(smollm2: PulledModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceProcess]:  # noqa: F811
    """Starts transformers on the GGUF at once; ``.result()`` waits for it."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("the parity reference needs transformers (the dev extra)")
    process = ReferenceProcess(smollm2, tmp_path_factory.mktemp("hf-reference"))
    try:
        yield process
    finally:
        process.stop()


# -- the project's side ------------------------------------------------------------------------------


def own_prefill_logits(model: PulledModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one batched prefill over the paged cache: the path the engine runs."""
    target = model.model
    kvm = KVCacheManager(num_blocks=256, block_size=16)
    kv = target.make_kv_storage(256, 16)
    requests = []
    for i, ids in enumerate(prompts):
        kvm.add_request(str(i))
        requests.append(ScheduledRequest(str(i), 0, len(ids)))
    reserve(requests, kvm)
    desc = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=sum(map(len, prompts)), num_reqs=len(prompts)
    )
    meta = build_target_metadata(requests, desc, kvm)
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    with torch.no_grad():
        out = target(input_ids, build_positions(requests, desc), meta, kv)
        logits = target.compute_logits(out.hidden_states)
    return list(logits.split([len(p) for p in prompts]))


def own_greedy(model: PulledModel, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy decoding through the Engine, all prompts batched, no stop tokens (so exactly 64 each)."""
    config = EngineConfig(
        num_blocks=64,
        block_size=16,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512),
    )
    engine = Engine(model.model, config)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, max_tokens=NEW_TOKENS)
    out = engine.run()
    return [out[f"p{i}"] for i in range(len(prompts))]


@dataclass
class Own:
    logits: list[torch.Tensor]
    continuations: list[list[int]]
    cpu_seconds: float


@pytest.fixture(scope="module")
def own(smollm2: PulledModel, reference: ReferenceProcess) -> Own:  # noqa: F811
    """Computed while the reference process runs (it is started first, by depending on it)."""
    start = time.process_time()
    logits = own_prefill_logits(smollm2, logit_prompts(smollm2))
    continuations = own_greedy(smollm2, greedy_prompts(smollm2))
    return Own(logits, continuations, time.process_time() - start)


# -- tokenizer (in this process, while the reference runs) --------------------------------------------


def test_tokenizer_and_chat_template_match_transformers(smollm2: PulledModel, reference: ReferenceProcess) -> None:  # noqa: F811
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    gguf = smollm2.source_gguf
    # The class itself rather than AutoTokenizer: same tokenizer, without parsing the GGUF again for a config (~7 s).
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = smollm2.tokenizer
    texts = [
        *PLAIN_PROMPTS,
        *CHAT_PROMPTS,
        *LOGIT_ONLY_PROMPTS,
        "  leading spaces, trailing spaces   \n\n\ttabs\r\nCRLF",
        "Emoji 🙂👍🏽, CJK 漢字かな, accents éàü, math ∑∫√, 12345 and 3.14159, x²+y²",
        "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
        inspect.getsource(textwrap),
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=True), text[:60]
        assert tok.decode(ids) == hf_tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert (tok.eos_token_id, tok.bos_token_id) == (hf_tok.eos_token_id, hf_tok.bos_token_id) == (2, 1)
    assert tok.vocab_size == len(hf_tok) == smollm2.model.config.vocab_size

    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
            assert tok.encode_chat(messages, add_generation_prompt=gen) == hf_tok.encode(
                expected, add_special_tokens=False
            )


def test_streaming_decode_of_real_output_equals_whole_decode(smollm2: PulledModel) -> None:  # noqa: F811
    tok = smollm2.tokenizer
    text = "Ünïcödé 🙂 streams: 日本語, emoji 👍🏽 and ∑ — whole characters only."
    ids = tok.encode(text)
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)


# -- the model -------------------------------------------------------------------------------------------


def test_logits_match_transformers(own: Own, reference: ReferenceProcess) -> None:
    ref = reference.result()
    worst = 0.0
    for i, (mine, theirs) in enumerate(zip(own.logits, ref.logits, strict=True)):
        assert mine.shape == theirs.shape, f"prompt {i}"
        worst = max(worst, (mine - theirs).abs().max().item())
        torch.testing.assert_close(mine, theirs, atol=LOGIT_ATOL, rtol=0, msg=lambda m, i=i: f"prompt {i}: {m}")
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1)), f"prompt {i}: argmax differs"
    positions = sum(t.shape[0] for t in own.logits)
    print(f"\nmax |logit difference| over {positions} positions: {worst:.2e} (own side {own.cpu_seconds:.1f} s CPU)")


def test_greedy_continuations_match_transformers(smollm2: PulledModel, own: Own, reference: ReferenceProcess) -> None:  # noqa: F811
    ref = reference.result()
    assert len(own.continuations) == len(ref.continuations) >= 5
    for i, (mine, theirs) in enumerate(zip(own.continuations, ref.continuations, strict=True)):
        assert len(mine) == len(theirs) == NEW_TOKENS
        if mine != theirs:
            first = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            pytest.fail(
                f"prompt {i}: greedy continuations differ from token {first} (reference top-1 margin along its "
                f"path >= {ref.margins[i]:.4f})\nours: {smollm2.tokenizer.decode(mine)!r}\n"
                f"ref:  {smollm2.tokenizer.decode(theirs)!r}"
            )
    print(f"\nsmallest top-1/top-2 logit margin along the reference paths: {min(ref.margins):.4f}")
