"""Run whole engines on several DP ranks, in-process (threads) or over gloo processes.

A ``DPRunSpec`` is plain, picklable data: every rank rebuilds the same target
from its config and seed, its own requests, and the speculator from a
module-level factory, so the same spec runs on threads and on processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, no_type_check

from hypothesis import strategies as st

from contracts import CUDAGraphMode
from specdec.dispatch import CaptureConfig
from specdec.dp_group import DPGroup, in_process_world, run_ranks, validate_timeout
from specdec.engine import Engine, EngineConfig, RunMetrics
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.request import FinishReason
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator
from specdec.testing.corpus import injected


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DPRunSpec:
    model: ModelConfig
    model_seed: int
    engine: EngineConfig
    requests: tuple[tuple[RequestSpec, ...], ...]
    """Requests of each rank; the tuple's length is the DP size."""
    speculator: Callable[[Transformer], Speculator] | None = None
    mutants: tuple[str, ...] = ()
    """Mutation-corpus mutants (``specdec.testing.corpus``) applied around the run, in every rank's process: how a
    regression test re-injects a known bug."""
    device: str = "cpu"
    """Where every rank builds its target (``cuda`` for the real-GPU tensor mode)."""

    @property
    def dp_size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class RankResult:
    outputs: dict[str, list[int]]
    metrics: RunMetrics
    collectives: int


_TARGETS: dict[tuple[str, int, str], Transformer] = {}
_TARGETS_LOCK = threading.Lock()


def shared_target(model: ModelConfig, seed: int, device: str = "cpu") -> Transformer:
    """One target per (config, seed, device) in this process: weights are read-only, and building
    them dominates short runs. Rank threads share it; gloo processes each build their own."""
    key = (model.model_dump_json(), seed, device)
    with _TARGETS_LOCK:
        target = _TARGETS.get(key)
        if target is None:
            if len(_TARGETS) >= 16:
                _TARGETS.clear()
            target = _TARGETS[key] = Transformer(model, seed=seed, device=device)
        return target


def run_rank(group: DPGroup | None, spec: DPRunSpec, rank: int = 0) -> RankResult:
    """One rank's whole run: build, add its requests, step until every rank is idle."""
    target = shared_target(spec.model, spec.model_seed, spec.device)
    speculator = spec.speculator(target) if spec.speculator is not None else None
    engine = Engine(target, spec.engine, speculator=speculator, dp_group=group)
    my_rank = group.rank if group is not None else rank
    for r in spec.requests[my_rank]:
        engine.add_request(
            r.req_id, list(r.prompt), params=r.params, max_tokens=r.max_tokens, stop_token_ids=r.stop_token_ids
        )
    outputs = engine.run()
    return RankResult(outputs, engine.metrics, group.collectives_run if group is not None else 0)


def run_in_process(spec: DPRunSpec, timeout_s: float = 30.0) -> list[RankResult]:
    """All ranks as threads of this process (the fast path for tests and the matrix)."""
    timeout_s = validate_timeout("timeout_s", timeout_s)  # also for one rank, which runs no collective
    with injected(spec.mutants):  # process-wide, so once for all rank threads
        if spec.dp_size == 1:
            return [run_rank(None, spec)]
        return run_ranks(lambda g: run_rank(g, spec), in_process_world(spec.dp_size, timeout_s=timeout_s))


def run_gloo_rank(group: DPGroup, spec: DPRunSpec) -> RankResult:
    """Entry point of one gloo process (``specdec.testing.distributed.run_gloo``)."""
    with injected(spec.mutants):  # a spawned process: the mutants are applied in it, not inherited
        return run_rank(group, spec)


def plain_outputs(spec: DPRunSpec) -> dict[str, list[int]]:
    """Every rank's requests decoded plainly on one rank: the reference output."""
    flat = tuple(r for rank in spec.requests for r in rank)
    single = DPRunSpec(spec.model, spec.model_seed, spec.engine, (flat,), None, device=spec.device)
    return run_rank(None, single).outputs


_PlainKey = tuple[str, int, str, tuple[int, ...], tuple[int, ...], int]
_PLAIN_MAX = 100_000
_plain: dict[_PlainKey, tuple[tuple[int, ...], bool]] | None = None
_plain_lock = threading.Lock()


def set_reference_cache(enabled: bool) -> bool:
    """Turn the process's plain-reference cache on (empty) or off (dropped); returns whether it was on.

    Only for runs whose code is not patched while the cache lives (the matrix):
    a reference decoded before a mutant was applied would hide it.
    """
    global _plain
    was = _plain is not None
    _plain = ({} if not was else _plain) if enabled else None
    return was


@contextmanager
def reference_cache() -> Iterator[None]:
    """``plain_reference`` reuses continuations inside the block (nested blocks share the outer cache)."""
    was = set_reference_cache(True)
    try:
        yield
    finally:
        set_reference_cache(was)


def _plain_key(spec: DPRunSpec, model: str, r: RequestSpec) -> _PlainKey:
    return (
        model,
        spec.model_seed,
        spec.device,
        r.prompt,
        tuple(sorted(r.stop_token_ids)),
        spec.engine.scheduler.max_model_len,
    )


def plain_reference(spec: DPRunSpec) -> dict[str, list[int]]:
    """The plain greedy output of every greedy request of ``spec`` (sampled ones have no token-exact reference).

    Without the cache (``reference_cache``) this is ``plain_outputs``. With it,
    only what this process has not decoded yet is decoded: greedy decoding is a
    function of the target, the prompt, the stop tokens and the model length,
    and ``max_tokens`` only cuts it, so a continuation is remembered per (target,
    prompt, stops, model length) with whether it ended on its own (stop token,
    model length) or at its ``max_tokens``. A request whose continuation is
    known far enough is answered from it; the others are decoded together on
    one plain engine, judged by the current contracts. Generated matrices repeat
    prompts often (across one backend's families, about two greedy requests in
    three repeat an earlier seed and prompt). Batch composition is assumed not
    to change an argmax, as every speculative-versus-plain comparison assumes.
    """
    cache = _plain
    greedy = [r for rank in spec.requests for r in rank if r.params.greedy]
    if cache is None:
        decoded = plain_outputs(spec)
        return {r.req_id: decoded[r.req_id] for r in greedy}
    out: dict[str, list[int]] = {}
    todo: list[RequestSpec] = []
    model = spec.model.model_dump_json()
    for r in greedy:
        known = cache.get(_plain_key(spec, model, r))
        if known is not None and (known[1] or len(known[0]) >= r.max_tokens):
            out[r.req_id] = list(known[0][: r.max_tokens])
        else:
            todo.append(r)
    if not todo:
        return out
    engine = Engine(shared_target(spec.model, spec.model_seed, spec.device), spec.engine)
    added = {
        r.req_id: engine.add_request(
            r.req_id, list(r.prompt), params=r.params, max_tokens=r.max_tokens, stop_token_ids=r.stop_token_ids
        )
        for r in todo
    }
    decoded = engine.run()
    with _plain_lock:
        if len(cache) >= _PLAIN_MAX:
            cache.clear()
        for r in todo:
            tokens = decoded[r.req_id]
            ended = added[r.req_id].finish_reason is not FinishReason.MAX_TOKENS
            key = _plain_key(spec, model, r)
            known = cache.get(key)
            if known is None or len(tokens) > len(known[0]):
                cache[key] = (tuple(tokens), ended)
            out[r.req_id] = tokens
    return out


def merged(results: Sequence[RankResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        out.update(r.outputs)
    return out


@st.composite
@no_type_check
def dp_run_specs(draw: st.DrawFn, model: ModelConfig, dp_sizes: tuple[int, ...] = (1, 2, 4)) -> DPRunSpec:
    """A whole DP run without a speculator: uneven and idle ranks, mixed prompts, any graph mode.

    Small token budgets chunk prefills and mix them with decodes; rank 0 always
    has work, the others may idle. Callers add a speculator with
    ``dataclasses.replace(spec, speculator=...)``.
    """
    dp = draw(st.sampled_from(dp_sizes))
    mode = draw(st.sampled_from(list(CUDAGraphMode)))
    sizes = tuple(draw(st.sets(st.integers(1, 48), min_size=1, max_size=5)))
    budget = draw(st.integers(4, 48))
    ranks = []
    for rank in range(dp):
        n = draw(st.integers(0 if rank else 1, 4))
        reqs = tuple(
            RequestSpec(
                f"r{rank}.{i}",
                tuple(draw(st.lists(st.integers(0, model.vocab_size - 1), min_size=1, max_size=12))),
                max_tokens=draw(st.integers(1, 10)),
            )
            for i in range(n)
        )
        ranks.append(reqs)
    engine = EngineConfig(
        num_blocks=128,
        block_size=draw(st.sampled_from([2, 4, 8])),
        capture=CaptureConfig(mode=mode, capture_sizes=sizes),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64),
        draft_length=draw(st.sampled_from(["fixed", "adaptive"])),
    )
    return DPRunSpec(model, draw(st.integers(0, 3)), engine, tuple(ranks), None)
