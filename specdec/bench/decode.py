"""Benchmark: plain greedy decoding of a real model through ``Engine``, beside transformers ``generate``, per dtype.

Batch 1, the same weights on both sides (the converted fp32 checkpoint from
the model store, cast to each dtype on load; ``reference="gguf"`` loads
transformers' own GGUF reader on the source file instead, ~30 s slower to
load), the same prompt token ids, no stop tokens on either side so both
decode exactly ``new_tokens``. Decode cost is timed per token from the first
generated token on (prefill reported apart).

Also times one target forward plus LM head for each of ``verify_lens`` query
tokens of one request at the decoded context (the target half of a verify
step; ``verify 1`` is a decode forward without the engine around it), on both
sides: the cache is filled once and the same forward repeated (the engine
rewrites the same slots; transformers' cache is cropped back).

The host is shared, so every figure is taken in rounds: each round runs every
side (engine and transformers, each dtype) once, in a rotating order, and the
report gives the median over rounds and the best round. Ratios within one run
are what to compare; the load average before and after is reported with them.
Nothing is downloaded: the model must be pulled.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

from specdec.engine import Engine, EngineConfig
from specdec.nn.packed_linear import fp32_kernel_choice
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig

DEFAULT_PROMPT = "Write a Python function that reverses a string."
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VERIFY_REPEATS = 3
"""Forwards per verify measurement in a round; the round keeps their median."""


@dataclass
class SideTiming:
    """One implementation in one dtype: a value per round (milliseconds)."""

    name: str
    dtype: str
    decode_ms_per_token: list[float] = field(default_factory=list)
    decode_cpu_ms_per_token: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    verify_ms: dict[int, list[float]] = field(default_factory=dict)
    verify_cpu_ms: dict[int, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} {self.dtype}"

    def summary(self) -> dict[str, Any]:
        return {
            "decode_ms_per_token": _median(self.decode_ms_per_token),
            "decode_ms_per_token_min": min(self.decode_ms_per_token, default=float("nan")),
            "decode_cpu_ms_per_token": _median(self.decode_cpu_ms_per_token),
            "prefill_ms": _median(self.prefill_ms),
            "verify_ms": {str(k): _median(v) for k, v in sorted(self.verify_ms.items())},
            "verify_ms_min": {str(k): min(v) for k, v in sorted(self.verify_ms.items())},
            "verify_cpu_ms": {str(k): _median(v) for k, v in sorted(self.verify_cpu_ms.items())},
        }


@dataclass
class DecodeBench:
    model: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    threads: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    sides: list[SideTiming]
    tokens_agree: dict[str, bool]
    """Per dtype, whether engine and transformers produced the same greedy tokens (absent without a reference)."""
    fp32_kernels: str = ""
    """Which kernel the engine's float32 products of a few rows ran on (``fp32_kernel_choice``); "" without float32."""

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "sides"}
        out["sides"] = {s.label: s.summary() for s in self.sides}
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
    request = engine.add_request("bench", list(prompt), max_tokens=new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        engine.step()
        first, first_cpu = time.perf_counter(), time.process_time()
        while engine.has_work:
            engine.step()
        end, end_cpu = time.perf_counter(), time.process_time()
    out = list(request.output)
    steps = max(1, len(out) - 1)
    return Run((first - start) * 1e3, (end - first) * 1e3 / steps, (end_cpu - first_cpu) * 1e3 / steps, out)


def engine_verify_forward(
    model: Transformer, prompt: Sequence[int], context: int, query_len: int
) -> Callable[[], float]:
    """A timer of one target forward plus LM head over ``query_len`` tokens of one request with ``context`` cached.

    The context is prefilled once; each call reruns the same forward (rewriting the same slots) and returns ms.
    """
    from contracts import BatchExecutionDescriptor, CUDAGraphMode
    from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata, reserve
    from specdec.kv_cache import KVCacheManager

    blocks = (context + query_len) // 16 + 2
    kvm = KVCacheManager(blocks, 16)
    kv = model.make_kv_storage(blocks, 16)
    kvm.add_request("r")
    ids = [prompt[i % len(prompt)] for i in range(context + query_len)]

    def inputs(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        reqs = [ScheduledRequest("r", start, n)]
        reserve(reqs, kvm)
        desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=n, num_reqs=1)
        meta = build_target_metadata(reqs, desc, kvm)
        return torch.tensor(ids[start : start + n], dtype=torch.int64), build_positions(reqs, desc), meta

    with torch.inference_mode():
        prefill_ids, prefill_positions, prefill_meta = inputs(0, context)
        model(prefill_ids, prefill_positions, prefill_meta, kv)
        kvm.set_length("r", context)
        input_ids, positions, meta = inputs(context, query_len)

    def forward() -> float:
        with torch.inference_mode():
            began = time.perf_counter()
            out = model(input_ids, positions, meta, kv)
            model.compute_logits(out.hidden_states)
            return (time.perf_counter() - began) * 1e3

    forward()  # warm-up (packs the weights on first use)
    return forward


# -- the transformers side -------------------------------------------------------------------------------------


def load_reference(name: str, source: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' Llama on the same weights in ``dtype``, offline: the converted checkpoint or the source GGUF."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    from specdec.hub import ModelStore

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    store = ModelStore()
    if source == "gguf":
        gguf = store.source_gguf(name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(store.path(name)), dtype=dtype)
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


def reference_verify_forward(hf: Any, prompt: Sequence[int], context: int, query_len: int) -> Callable[[], float]:
    """transformers' forward plus LM head for ``query_len`` tokens after ``context`` cached ones (cache cropped back)."""
    import transformers

    ids = [prompt[i % len(prompt)] for i in range(context + query_len)]
    cache = transformers.DynamicCache(config=hf.config)
    query = torch.tensor([ids[context:]])
    with torch.inference_mode():
        hf(torch.tensor([ids[:context]]), cache=cache, use_cache=True)

    def forward() -> float:
        with torch.inference_mode():
            began = time.perf_counter()
            hf(query, cache=cache, use_cache=True)
            elapsed = (time.perf_counter() - began) * 1e3
        cache.crop(-query_len)  # transformers 5: a negative count of tokens to drop
        return elapsed

    forward()
    return forward


# -- driver ----------------------------------------------------------------------------------------------------


@dataclass
class _Side:
    """What one round needs to time a side: its decode, and its verify timers by query length."""

    timing: SideTiming
    decode: Callable[[], Run]
    verify: dict[int, Callable[[], float]]


def measure(
    model_name: str = "smollm2-135m-instruct",
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    verify_lens: Sequence[int] = (1, 2, 4, 5, 8),
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    threads: int | None = None,
    reference: str = "converted",
    prompt: str = DEFAULT_PROMPT,
    chat: bool = True,
    log: Callable[[str], None] = print,
) -> DecodeBench:
    """Run every side (engine and transformers, each dtype) once per round, ``repeats`` rounds; see the module doc."""
    from specdec.hub import load

    if reference not in ("converted", "gguf", "none"):
        raise ValueError(f"reference must be 'converted', 'gguf' or 'none', got {reference!r}")
    if new_tokens < 2 or repeats < 1:
        raise ValueError(f"need new_tokens >= 2 and repeats >= 1, got {new_tokens} and {repeats}")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"dtypes must be a non-empty subset of {sorted(DTYPES)}, got {list(dtypes)}")
    if any(q < 1 for q in verify_lens):
        raise ValueError(f"verify lengths must be >= 1, got {list(verify_lens)}")
    if threads is not None:
        torch.set_num_threads(threads)
    load_before = os.getloadavg()
    sides: list[_Side] = []
    ids: list[int] = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        model, tokenizer = load(model_name, dtype=dtype, download=False)
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
        context = len(ids) + new_tokens
        sides.append(
            _Side(
                SideTiming("engine", dtype_name),
                functools.partial(engine_decode, model, ids, new_tokens),
                {q: engine_verify_forward(model, ids, context, q) for q in verify_lens},
            )
        )
        if reference == "none":
            continue
        try:
            started = time.perf_counter()
            hf = load_reference(model_name, reference, dtype)
        except ImportError as exc:
            log(f"transformers is not installed ({exc}); timing the engine alone")
            reference = "none"
            continue
        log(f"transformers loaded ({reference}, {dtype_name}) in {time.perf_counter() - started:.1f} s")
        sides.append(
            _Side(
                SideTiming("transformers", dtype_name),
                functools.partial(reference_decode, hf, ids, new_tokens),
                {q: reference_verify_forward(hf, ids, context, q) for q in verify_lens},
            )
        )
    for r in range(repeats):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]  # rotate who goes first
        line = f"round {r + 1}/{repeats}:"
        for side in order:
            run = side.decode()
            t = side.timing
            t.prefill_ms.append(run.prefill_ms)
            t.decode_ms_per_token.append(run.decode_ms)
            t.decode_cpu_ms_per_token.append(run.decode_cpu_ms)
            t.tokens = run.tokens
            line += f"  {t.label} {run.decode_ms:.1f}"
        for q in verify_lens:
            for side in order:
                times, cpu = [], []
                for _ in range(VERIFY_REPEATS):
                    began = time.process_time()
                    times.append(side.verify[q]())
                    cpu.append((time.process_time() - began) * 1e3)
                side.timing.verify_ms.setdefault(q, []).append(statistics.median(times))
                side.timing.verify_cpu_ms.setdefault(q, []).append(statistics.median(cpu))
        log(line + " ms/token")
    timings = [s.timing for s in sides]
    agree = {}
    for dtype_name in dtypes:
        pair = [t for t in timings if t.dtype == dtype_name]
        if len(pair) == 2:
            agree[dtype_name] = pair[0].tokens == pair[1].tokens
    return DecodeBench(
        model_name,
        len(ids),
        new_tokens,
        repeats,
        torch.get_num_threads(),
        load_before,
        os.getloadavg(),
        timings,
        agree,
        fp32_kernel_choice() if "float32" in dtypes else "",
    )


def format_report(bench: DecodeBench) -> str:
    lens = sorted(bench.sides[0].verify_ms)
    lines = [
        f"{bench.model}: batch 1 greedy, {bench.prompt_tokens}-token prompt, {bench.new_tokens} new tokens, "
        f"{bench.threads} thread(s), medians of {bench.repeats} rounds; load average "
        f"{bench.load_before[0]:.1f} before, {bench.load_after[0]:.1f} after"
        + (f"; engine float32: {bench.fp32_kernels}" if bench.fp32_kernels else ""),
        f"{'':<22}{'decode ms/token (best)':>24}{'cpu':>7}{'prefill':>9}"
        + "".join(f"{f'verify {q} (cpu)':>17}" for q in lens),
    ]
    for side in bench.sides:
        s = side.summary()
        lines.append(
            f"{side.label:<22}{s['decode_ms_per_token']:16.1f} ({s['decode_ms_per_token_min']:5.1f})"
            f"{s['decode_cpu_ms_per_token']:7.1f}{s['prefill_ms']:9.0f}"
            + "".join(f"{s['verify_ms'][str(q)]:10.1f} ({s['verify_cpu_ms'][str(q)]:4.1f})" for q in lens)
        )
    for dtype_name, agree in bench.tokens_agree.items():
        engine, hf = (t.summary() for t in bench.sides if t.dtype == dtype_name)
        wall = engine["decode_ms_per_token"] / hf["decode_ms_per_token"]
        cpu = engine["decode_cpu_ms_per_token"] / hf["decode_cpu_ms_per_token"]
        lines.append(
            f"{dtype_name}: engine / transformers decode time {wall:.2f} wall, {cpu:.2f} cpu"
            f" (below 1: the engine is faster); greedy tokens identical: {'yes' if agree else 'no'}"
        )
    for side in bench.sides:
        if side.name == "engine" and 1 in side.verify_ms:
            v, c = side.summary()["verify_ms"], side.summary()["verify_cpu_ms"]
            ratios = ", ".join(f"{q}: {v[str(q)] / v['1']:.2f} ({c[str(q)] / c['1']:.2f})" for q in lens if q != 1)
            lines.append(f"engine {side.dtype}: verify N / verify 1, wall (cpu) = {ratios}")
    lines.append(
        "verify N = one forward + LM head over N query tokens at the decoded context (the target's verify cost); "
        "cpu = process CPU time (per decoded token, per verify forward), steadier than wall time on a busy host"
    )
    return "\n".join(lines)


class MeasureOptions(TypedDict, total=False):
    """``measure``'s keyword options, so ``main`` passes them on without repeating them."""

    new_tokens: int
    repeats: int
    verify_lens: Sequence[int]
    dtypes: Sequence[str]
    threads: int | None
    reference: str
    prompt: str
    chat: bool


def main(
    model: str = "smollm2-135m-instruct", *, json_path: str | None = None, **options: Unpack[MeasureOptions]
) -> int:
    """Print the report (and write it as JSON to ``json_path``); 0 on success, 1 when the model is not pulled."""
    from specdec.hub import ModelStoreError, UnknownModelError

    try:
        bench = measure(model, **options)
    except (ModelStoreError, UnknownModelError) as exc:
        print(f"bench-decode: {exc} (pull it first: specdec models pull {model})")
        return 1
    print(format_report(bench))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(bench.as_dict(), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
