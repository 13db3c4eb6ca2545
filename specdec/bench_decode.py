"""Benchmark: plain greedy decoding of a real model through ``Engine``, beside transformers ``generate``.

Batch 1, the same weights on both sides (the converted fp32 checkpoint from
the model store; ``reference="gguf"`` loads transformers' own GGUF reader on
the source file instead, ~30 s slower to load, same numbers), the same prompt
token ids, no stop tokens on either side so both decode exactly
``new_tokens``. Decode cost is timed per token from the first generated token
on (prefill reported apart). Runs alternate between the two sides and the
median of ``repeats`` is reported, so that a noisy shared host slows both
alike. Also times one target forward plus LM head for ``1, 4, 8`` query
tokens at the decoded context (the target half of a verify step), on both
sides. Nothing is downloaded: the model must be pulled.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.engine import Engine, EngineConfig
from specdec.model.transformer import Transformer
from specdec.scheduler import SchedulerConfig

DEFAULT_PROMPT = "Write a Python function that reverses a string."


@dataclass
class SideTiming:
    """One implementation's figures, medians over the repeats (milliseconds)."""

    name: str
    decode_ms_per_token: list[float] = field(default_factory=list)
    decode_cpu_ms_per_token: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    verify_ms: dict[int, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "decode_ms_per_token": _median(self.decode_ms_per_token),
            "decode_ms_per_token_min": min(self.decode_ms_per_token, default=float("nan")),
            "decode_cpu_ms_per_token": _median(self.decode_cpu_ms_per_token),
            "prefill_ms": _median(self.prefill_ms),
            "verify_ms": {str(k): _median(v) for k, v in sorted(self.verify_ms.items())},
        }


@dataclass
class DecodeBench:
    model: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    threads: int
    sides: list[SideTiming]
    tokens_agree: bool | None

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "sides"}
        out["sides"] = {s.name: s.summary() for s in self.sides}
        return out


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- the engine side -------------------------------------------------------------------------------------------


def _engine(model: Transformer, max_model_len: int) -> Engine:
    blocks = max_model_len // 16 + 2
    scheduler = SchedulerConfig(
        max_num_batched_tokens=max(512, max_model_len), max_num_seqs=8, max_model_len=max_model_len
    )
    return Engine(model, EngineConfig(num_blocks=blocks, block_size=16, scheduler=scheduler))


@dataclass(frozen=True)
class Run:
    """One decode: prefill wall ms, decode wall and CPU ms per token (after the first), the tokens."""

    prefill_ms: float
    decode_ms: float
    decode_cpu_ms: float
    tokens: list[int]


def engine_decode(model: Transformer, prompt: Sequence[int], new_tokens: int) -> Run:
    """One greedy run through ``Engine`` (plain decoding, no stop tokens)."""
    engine = _engine(model, len(prompt) + new_tokens + 16)
    engine.add_request("bench", list(prompt), max_tokens=new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        engine.step()
        first, first_cpu = time.perf_counter(), time.process_time()
        while engine.has_work:
            engine.step()
        end, end_cpu = time.perf_counter(), time.process_time()
    out = list(engine.requests["bench"].output)
    steps = max(1, len(out) - 1)
    return Run((first - start) * 1e3, (end - first) * 1e3 / steps, (end_cpu - first_cpu) * 1e3 / steps, out)


def engine_verify_forward(model: Transformer, prompt: Sequence[int], context: int, query_len: int) -> float:
    """Ms of one target forward plus LM head over ``query_len`` new tokens of one request with ``context`` cached."""
    from contracts import BatchExecutionDescriptor, CUDAGraphMode
    from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata, reserve
    from specdec.kv_cache import KVCacheManager

    blocks = (context + query_len) // 16 + 2
    kvm = KVCacheManager(blocks, 16)
    kv = model.make_kv_storage(blocks, 16)
    kvm.add_request("r")
    ids = [prompt[i % len(prompt)] for i in range(context + query_len)]

    def forward(start: int, n: int) -> float:
        reqs = [ScheduledRequest("r", start, n)]
        reserve(reqs, kvm)
        desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=n, num_reqs=1)
        meta = build_target_metadata(reqs, desc, kvm)
        positions = build_positions(reqs, desc)
        input_ids = torch.tensor(ids[start : start + n], dtype=torch.int64)
        began = time.perf_counter()
        out = model(input_ids, positions, meta, kv)
        model.compute_logits(out.hidden_states)
        return (time.perf_counter() - began) * 1e3

    with torch.inference_mode():
        forward(0, context)
        kvm.set_length("r", context)
        forward(context, query_len)  # warm-up; the same slots are rewritten below
        return statistics.median(forward(context, query_len) for _ in range(3))


# -- the transformers side -------------------------------------------------------------------------------------


def load_reference(name: str, source: str) -> Any:
    """transformers' Llama on the same weights, offline: the converted checkpoint or the source GGUF."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    from specdec.models import ModelStore

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    store = ModelStore()
    if source == "gguf":
        gguf = store.source_gguf(name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(store.path(name)), dtype=torch.float32)
    return model.eval()


class _Stamps:
    """A ``generate`` streamer that only notes when each chunk of tokens arrives (wall and CPU clocks)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self) -> None:
        pass


def reference_decode(hf: Any, prompt: Sequence[int], new_tokens: int) -> Run:
    """One transformers ``generate`` (greedy, no EOS stop), timed like ``engine_decode``."""
    stamps = _Stamps()
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=[],  # decode exactly new_tokens, as the engine does without stop tokens (None means default)
            streamer=stamps,
        )
    tokens = out[0, len(prompt) :].tolist()
    steps = max(1, len(stamps.times) - 2)  # [0] is the prompt itself, [1] the first token (after the prefill)
    return Run(
        (stamps.times[1] - start) * 1e3,
        (stamps.times[-1] - stamps.times[1]) * 1e3 / steps,
        (stamps.cpu[-1] - stamps.cpu[1]) * 1e3 / steps,
        tokens,
    )


def reference_verify_forward(hf: Any, prompt: Sequence[int], context: int, query_len: int) -> float:
    """transformers' forward plus LM head for ``query_len`` tokens after ``context`` cached ones (cache cropped back)."""
    import transformers

    ids = [prompt[i % len(prompt)] for i in range(context + query_len)]
    cache = transformers.DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([ids[:context]]), cache=cache, use_cache=True)

        def forward() -> float:
            began = time.perf_counter()
            hf(torch.tensor([ids[context:]]), cache=cache, use_cache=True)
            elapsed = (time.perf_counter() - began) * 1e3
            cache.crop(-len(ids[context:]))  # transformers 5: a negative count of tokens to drop
            return elapsed

        forward()
        return statistics.median(forward() for _ in range(3))


# -- driver ----------------------------------------------------------------------------------------------------


def measure(
    model_name: str = "smollm2-135m-instruct",
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    verify_lens: Sequence[int] = (1, 4, 8),
    threads: int | None = None,
    reference: str = "converted",
    prompt: str = DEFAULT_PROMPT,
    chat: bool = True,
    log: Callable[[str], None] = print,
) -> DecodeBench:
    """Run both sides alternately ``repeats`` times; see the module docstring."""
    from specdec.models import load

    if reference not in ("converted", "gguf", "none"):
        raise ValueError(f"reference must be 'converted', 'gguf' or 'none', got {reference!r}")
    if new_tokens < 2 or repeats < 1:
        raise ValueError(f"need new_tokens >= 2 and repeats >= 1, got {new_tokens} and {repeats}")
    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = load(model_name, download=False)
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    engine_side = SideTiming("engine")
    sides = [engine_side]
    hf = None
    if reference != "none":
        try:
            started = time.perf_counter()
            hf = load_reference(model_name, reference)
            log(f"transformers loaded ({reference}) in {time.perf_counter() - started:.1f} s")
            sides.append(SideTiming("transformers"))
        except ImportError as exc:
            log(f"transformers is not installed ({exc}); timing the engine alone")
    context = len(ids) + new_tokens
    for r in range(repeats):
        line = f"run {r + 1}/{repeats}:"
        for side in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
            run = (
                engine_decode(model, ids, new_tokens) if side is engine_side else reference_decode(hf, ids, new_tokens)
            )
            side.prefill_ms.append(run.prefill_ms)
            side.decode_ms_per_token.append(run.decode_ms)
            side.decode_cpu_ms_per_token.append(run.decode_cpu_ms)
            side.tokens = run.tokens
            line += f"  {side.name} {run.decode_ms:6.1f} ms/token (cpu {run.decode_cpu_ms:6.1f})"
        log(line)
        for q in verify_lens:
            engine_side.verify_ms.setdefault(q, []).append(engine_verify_forward(model, ids, context, q))
            if hf is not None:
                sides[1].verify_ms.setdefault(q, []).append(reference_verify_forward(hf, ids, context, q))
    agree = None if hf is None else sides[0].tokens == sides[1].tokens
    return DecodeBench(model_name, len(ids), new_tokens, repeats, torch.get_num_threads(), sides, agree)


def format_report(bench: DecodeBench) -> str:
    lines = [
        f"{bench.model}: batch 1 greedy, {bench.prompt_tokens}-token prompt, {bench.new_tokens} new tokens, "
        f"{bench.threads} thread(s), median of {bench.repeats}",
        f"{'':<14}{'decode ms/token':>16}{'(best)':>8}{'cpu ms/token':>14}{'prefill ms':>12}"
        + "".join(f"{f'verify {q} ms':>13}" for q in sorted(bench.sides[0].verify_ms)),
    ]
    for side in bench.sides:
        s = side.summary()
        lines.append(
            f"{side.name:<14}{s['decode_ms_per_token']:16.1f}{s['decode_ms_per_token_min']:8.1f}"
            f"{s['decode_cpu_ms_per_token']:14.1f}{s['prefill_ms']:12.1f}"
            + "".join(f"{v:13.1f}" for v in s["verify_ms"].values())
        )
    if len(bench.sides) == 2:
        e, t = (side.summary()["decode_ms_per_token"] for side in bench.sides)
        ec, tc = (side.summary()["decode_cpu_ms_per_token"] for side in bench.sides)
        lines.append(
            f"engine / transformers decode time: {e / t:.2f} wall, {ec / tc:.2f} cpu  (below 1: the engine is faster)"
        )
        lines.append(f"greedy tokens identical: {'yes' if bench.tokens_agree else 'no'}")
    lines.append(
        "verify N = one forward + LM head over N query tokens at the decoded context (the target's verify cost); "
        "cpu = process CPU time, steadier than wall time on a shared host (with 1 thread)"
    )
    return "\n".join(lines)


def main(
    model: str = "smollm2-135m-instruct",
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    verify_lens: Sequence[int] = (1, 4, 8),
    threads: int | None = None,
    reference: str = "converted",
    json_path: str | None = None,
) -> int:
    """Print the report (and write it as JSON to ``json_path``); 0 on success, 1 when the model is not pulled."""
    from specdec.models import ModelStoreError, UnknownModelError

    try:
        bench = measure(
            model, new_tokens=new_tokens, repeats=repeats, verify_lens=verify_lens, threads=threads, reference=reference
        )
    except (ModelStoreError, UnknownModelError) as exc:
        print(f"bench-decode: {exc} (pull it first: specdec models pull {model})")
        return 1
    print(format_report(bench))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(bench.as_dict(), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
