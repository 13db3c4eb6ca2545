"""The conformance suite: drive any ``Speculator`` factory through generated configuration families.

A backend author hands ``check_backend`` the factory their backend is built
from (``factory(target, **options) -> Speculator``, the entry-point shape).
Each *family* is a Hypothesis strategy over whole DP runs that stresses one
axis where padding bugs live: DP size with uneven and idle ranks, CUDA-graph
mode and capture sizes, draft length, chunked prefill mixed with decode,
forced acceptance patterns (``ForcedAcceptance``), sampled requests, and
(for backends that take a ``capacity`` option) DSpark-style capacities. Every
example runs every rank's engine with contracts enforced and, for greedy
requests, compares the output with plain decoding token for token. The report says, per family and tensor
mode, how many examples were tried and which invariant (or mismatch, or
crash) the first failing one hit. It also counts the invariant evaluations
per step kind, and a family in which a drafting backend's forwards met no
invariant fails as ``unchecked-forwards`` (``forward_coverage``): a pass that
checked nothing is not a pass.

Tensor modes: ``cpu`` runs real CPU tensors in ``full`` contract mode (value
contracts and exact losslessness); ``fake-cuda`` runs the CPU example while
recording every call the engine made into the backend, then replays those calls
on a backend bound to a data-less device target in ``shapes`` mode: ``cuda``
under ``FakeTensorMode`` where torch has CUDA built in, the ``meta`` device on
a CPU-only build (see ``replay_device``). That is the GPU path's shapes,
devices and step counts with no data and no GPU: a value read on the drafting
path (a hidden device sync) or a host tensor mixed into device compute fails
there; ``cuda`` runs the CPU checks on a real GPU and is skipped, never
failed, without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, no_type_check

import hypothesis
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import contracts
from contracts import ContractViolation, CUDAGraphMode
from contracts.tally import tallying
from specdec.backend_registry import names_option
from specdec.dispatch import CaptureConfig
from specdec.dp_group import in_process_world, run_ranks
from specdec.engine import EngineConfig
from specdec.kv_cache import blocks_for
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import ModelOutput, Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import ContextTaker, DraftContext, Speculator, TargetStep, check_proposal
from specdec.testing.axes import (
    AXES_UNREACHED,
    BOUNDARIES,
    DP_SIZES,
    PATH_OPTIONS,
    AxesReached,
    BoundaryWatch,
    option_combinations,
    path_options,
    required_axes,
)
from specdec.testing.dp_run import (
    DPRunSpec,
    RankResult,
    RequestSpec,
    merged,
    plain_reference,
    run_in_process,
    shared_target,
)
from specdec.testing.forced_acceptance import ForcedAcceptance
from specdec.testing.forward_coverage import UNCHECKED_FORWARDS, ForwardCoverage, ObservedSpeculator
from specdec.testing.hidden_sync import naming_hidden_syncs
from specdec.testing.host_copies import HostCopiesOfMeta
from specdec.testing.meta_memo import MetaMemo

Factory = Callable[..., Speculator]

FAMILIES: dict[str, str] = {
    "dp": "DP size 1/2/4/8 with uneven and idle ranks (eager: each rank keeps its own count)",
    "graph": "CUDA-graph mode NONE/PIECEWISE/FULL with generated capture sizes, DP 1-2",
    "draft-length": "draft length K = 1..8",
    "chunked-prefill": "long prompts under a small token budget: prefill chunks mixed with decodes",
    "acceptance": "forced all-accept / all-reject / random acceptance of the backend's drafts",
    "sampling": "temperature, top-k and top-p requests mixed with greedy ones (contracts only for sampled rows)",
    "capacity": "draft capacities by threshold and by budget (backends with a `capacity` option)",
}
TENSOR_MODES = ("cpu", "fake-cuda", "cuda")
MODEL = ModelConfig.tiny()
"""The matrix's target: 2 layers, hidden 32, vocabulary 96 — small enough for thousands of runs."""


# -- one example -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One generated configuration: a DP run plus the backend options and the acceptance pattern to force."""

    family: str
    run: DPRunSpec
    options: Mapping[str, Any]
    acceptance: str | None = None
    """``all-accept``, ``all-reject``, ``random`` or None (the backend's own drafts are verified)."""

    def describe(self) -> str:
        ranks = "/".join(str(len(r)) for r in self.run.requests)
        cap = self.run.engine.capture
        return (
            f"family={self.family} dp={self.run.dp_size} requests/rank={ranks} mode={cap.mode.name} "
            f"capture_sizes={list(cap.capture_sizes)} budget={self.run.engine.scheduler.max_num_batched_tokens} "
            f"options={dict(self.options)} acceptance={self.acceptance} seed={self.run.model_seed}"
        )


@dataclass(frozen=True)
class Outcome:
    """What one example did: ``ok``, or the invariant ID / ``mismatch`` / exception type that stopped it."""

    ok: bool
    caught_by: str | None = None
    message: str = ""


def failed(error: BaseException, where: str = "") -> Outcome:
    """The outcome of an example stopped by ``error``: caught by its invariant ID (or its type), said once.

    The report writes ``caught_by: message``, so the message leaves out the
    ``[ID]`` a violation's text opens with and the ``Type:`` of a crash's.
    """
    if isinstance(error, ContractViolation):
        caught_by = error.invariant_id
        text = str(error).removeprefix(f"[{caught_by}] ")
    else:
        caught_by = type(error).__name__
        text = "".join(traceback.format_exception_only(error)).strip()
        for prefix in (f"{type(error).__module__}.{type(error).__qualname__}", type(error).__qualname__):
            if text == prefix or text.startswith(prefix + ":"):
                text = text.removeprefix(prefix).removeprefix(":").strip()
                break
    return Outcome(False, caught_by, where + (text or "(no message)"))


def run_case(
    factory: Factory,
    case: Case,
    *,
    tensor_mode: str = "cpu",
    mode: str = "full",
    timeout_s: float = 20.0,
    coverage: ForwardCoverage | None = None,
    reached: AxesReached | None = None,
) -> Outcome:
    """Run one configuration on every rank; compare greedy outputs with plain decoding (and replay on fake cuda).

    ``coverage`` gathers what the backend declared and drafted and the
    invariant evaluations of the run and its replay (``forward_coverage``);
    ``reached`` the axis values the example configured and ran into.
    """
    recorders: list[ObservedSpeculator] = []

    def build(target: Transformer) -> Speculator:
        recorder = ObservedSpeculator(factory(target, **case.options), record_calls=tensor_mode == "fake-cuda")
        recorders.append(recorder)
        return recorder

    def counting() -> contextlib.AbstractContextManager[object]:
        """The backend's runs are counted; the plain reference's checks are no evidence about the backend."""
        return tallying(coverage.tally) if coverage is not None else contextlib.nullcontext()

    outcome, results = _run_and_replay(factory, case, build, recorders, counting, tensor_mode, mode, timeout_s)
    if coverage is not None:
        coverage.observe(recorders, sum(r.metrics.drafted for r in results))
    if reached is not None:
        _record_axes(reached, case, [r.watch for r in recorders])
    return outcome


def _record_axes(reached: AxesReached, case: Case, watches: Sequence[BoundaryWatch]) -> None:
    """What ``case`` configured (options, DP size, K, acceptance, capacity, sampling) and what its ranks ran into."""
    options, dp = case.options, case.run.dp_size
    for name in PATH_OPTIONS:
        if name in options:
            reached.add(name, options[name])
    reached.add("dp_size", dp)
    reached.add("num_spec_tokens", options.get("num_spec_tokens"))
    if case.acceptance is not None:
        reached.add("acceptance", case.acceptance)
    if "capacity" in options:
        measured = options["capacity"] == "budget" and "c0" not in options
        reached.add("capacity", "budget-measured-cost" if measured else options["capacity"])
    if any(not r.params.greedy for rank in case.run.requests for r in rank):
        reached.add("sampled_request", True)
    for w in watches:
        reached.update({"graph_mode": w.graph_modes})
        if w.prefill_chunked:
            reached.add("prefill_chunked", True)
        if w.drafted_into_max_model_len:
            reached.add("drafted_into_max_model_len_at_dp", dp)
        if w.preempted:
            reached.add("preempted_while_speculating_at_dp", dp)
        if w.looked_up:
            reached.add("lookup_drafted", True)
        if w.lookup_drafted_past_k:
            reached.add("lookup_drafted_past_k", True)


def _run_and_replay(
    factory: Factory,
    case: Case,
    build: Callable[[Transformer], Speculator],
    recorders: list[ObservedSpeculator],
    counting: Callable[[], contextlib.AbstractContextManager[object]],
    tensor_mode: str,
    mode: str,
    timeout_s: float,
) -> tuple[Outcome, list[RankResult]]:
    """``run_case``'s work: the outcome, and the ranks' results when the speculative run finished."""
    device = "cuda" if tensor_mode == "cuda" else "cpu"
    spec = dataclasses.replace(case.run, speculator=build, device=device)
    # The fake-cuda example's CPU run only records calls for the replay: the cpu mode already checks values and
    # losslessness on its own examples, so here plain decoding runs only when an acceptance pattern needs it.
    replaying = tensor_mode == "fake-cuda"
    if replaying:
        mode = "shapes"
    plain: dict[str, list[int]] | None = None
    results: list[RankResult] = []
    try:
        with contracts.enforce(mode):  # the plain reference is judged by the same contracts, inside the same guard
            if not replaying or case.acceptance is not None:
                plain = plain_reference(spec)  # greedy requests only: the rest are checked by contracts alone
            if case.acceptance is not None and plain is not None:
                prompts = {r.req_id: r.prompt for rank in spec.requests for r in rank}
                sequences = {rid: [*prompts[rid], *out] for rid, out in plain.items()}
                pattern, seed, vocab = case.acceptance, spec.model_seed, spec.model.vocab_size

                def forced(target: Transformer) -> Speculator:
                    return ForcedAcceptance(build(target), pattern, sequences, vocab, seed)

                spec = dataclasses.replace(spec, speculator=forced)
            with counting():
                results = run_in_process(spec, timeout_s=timeout_s)
    except Exception as e:  # a violation, a DP timeout or a crash: each is a finding, reported, never hidden
        return failed(e), results
    if tensor_mode == "fake-cuda":
        by_rank = sorted(recorders, key=lambda r: r.rank)  # rank threads build their recorders in any order
        try:
            with counting():
                replay_on_fake_cuda(factory, case, [r.events for r in by_rank], timeout_s)
        except Exception as e:
            return failed(e, "fake-cuda replay: "), results
    out = merged(results)
    if plain is None:
        return Outcome(True), results
    greedy = {r.req_id for rank in spec.requests for r in rank if r.params.greedy}
    wrong = sorted(rid for rid in greedy if out.get(rid) != plain.get(rid))
    missing = sorted({r.req_id for rank in spec.requests for r in rank} - set(out))
    if wrong or missing:
        detail = "; ".join(f"{rid}: {out.get(rid)} != plain {plain.get(rid)}" for rid in wrong[:3])
        message = f"requests {wrong} differ from plain decoding, {missing} lost. {detail}"
        return Outcome(False, "mismatch", message), results
    return Outcome(True), results


# -- fake CUDA: replay the engine's calls into a backend bound to a fake-cuda target -----------------------------


class _HostSyncContext(DraftContext):
    """The DP sync exchanges host integers (a CPU collective in production), so it runs on real tensors."""

    def sync(self, *args: Any, **kwargs: Any) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # a no-op outside FakeTensorMode (the meta replay)
            return super().sync(*args, **kwargs)


def replay_device() -> str:
    """``cuda`` under ``FakeTensorMode`` where torch is built with CUDA; ``meta`` on a CPU-only build.

    A CPU-only torch cannot copy host data into a fake ``cuda`` tensor (its
    device guard is missing), and host-to-device copies are everywhere in a
    drafter's step. ``meta`` keeps what the replay is for: no data, so any value
    read (a hidden sync) fails, and mixing host and device tensors in compute
    fails as it would on a GPU.
    """
    return "cuda" if torch.backends.cuda.is_built() else "meta"


def _to_device_step(step: TargetStep, move: Callable[[torch.Tensor], torch.Tensor]) -> TargetStep:
    output = ModelOutput(move(step.output.hidden_states), tuple(move(a) for a in step.output.aux_hidden_states))
    return dataclasses.replace(step, input_ids=move(step.input_ids), positions=move(step.positions), output=output)


def _replay_rank(group: Any, factory: Factory, case: Case, events: list[tuple[str, Any]], engine: EngineConfig) -> None:
    """One rank's recorded calls on a data-less device target, contracts in ``shapes`` mode, proposals checked."""
    device = replay_device()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contracts.enforce("shapes"))
        if device == "cuda":
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(naming_hidden_syncs())  # a data-dependent op: "hidden device sync at FILE:LINE"

            def move(t: torch.Tensor) -> torch.Tensor:
                return mode.from_tensor(t).to("cuda")
        else:
            # Meta kernels are Python on this build: compute each distinct call once (``meta_memo``).
            stack.enter_context(MetaMemo())
            stack.enter_context(HostCopiesOfMeta())  # ``.cpu()`` of device data: a data-less host tensor

            def move(t: torch.Tensor) -> torch.Tensor:
                return t.to("meta")

        if device == "meta":  # read-only and data-less: one per seed, like the CPU targets
            target = shared_target(case.run.model, case.run.model_seed, device)
        else:  # fake tensors belong to this replay's FakeTensorMode
            target = Transformer(case.run.model, seed=case.run.model_seed, device=device, draw_weights=False)
        speculator = factory(target, **case.options)
        ctx = _HostSyncContext(
            backend=speculator.name,
            step_kinds=speculator.draft_step_kinds,
            capture=engine.capture,
            dp_group=group,
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            max_model_len=engine.scheduler.max_model_len,
            max_num_seqs=engine.scheduler.max_num_seqs,
        )
        speculator.bind(target, ctx)
        for kind, payload in events:
            if kind == "finish":
                speculator.finish(payload)
                ctx.release([payload])  # the engine frees a preempted request's draft blocks, as here
                continue
            step = _to_device_step(payload, move)
            if kind == "take_context":  # a step where nobody drafted, taken in without a proposal, as in the engine
                if not isinstance(speculator, ContextTaker):
                    raise RuntimeError(f"the run called take_context on {speculator.name!r}, which has none here")
                ctx.take_context(speculator, step)
                continue
            proposal = ctx.propose(speculator, step)  # draft caches opened and committed around it, as in the engine
            check_proposal(proposal, step, speculator, component=f"{device} replay")
            placed = {t.device.type for t in (proposal.draft_token_ids, proposal.draft_probs) if t is not None}
            if placed != {device}:
                raise RuntimeError(f"the proposal of a {device} target's step lives on {sorted(placed)}")


def replay_on_fake_cuda(
    factory: Factory, case: Case, recorded: Sequence[list[tuple[str, Any]]], timeout_s: float
) -> None:
    """Replay every rank's recorded calls together (their DP syncs must line up exactly as on the CPU)."""
    engine = case.run.engine
    if len(recorded) == 1:
        _replay_rank(None, factory, case, recorded[0], engine)
        return
    run_ranks(
        lambda g: _replay_rank(g, factory, case, recorded[g.rank], engine),
        in_process_world(len(recorded), timeout_s=timeout_s),
    )


# -- the families ------------------------------------------------------------------------------------------------


LAYOUTS = ("idle", "uneven", "any")
"""How a DP run's ranks are filled: the last rank idle, the last rank's count unlike rank 0's, or as drawn."""
AXES: dict[str, tuple[Any, ...]] = {
    "dp": tuple((dp, LAYOUTS[i % 3], BOUNDARIES[i // 4]) for i, dp in enumerate(DP_SIZES * 3)),
    "graph": tuple((mode, (1, 2)[i % 2]) for i, mode in enumerate(tuple(CUDAGraphMode) * 2)),
    "draft-length": tuple((k, dp) for dp in (1, 2) for k in range(1, 9)),
    "chunked-prefill": ("long", "any"),
    "acceptance": ("all-accept", "all-reject", "random"),
    "sampling": ("sampled", "any"),
    "capacity": ("threshold", "budget", "budget-measured-cost", "full"),
}
"""The values each family cycles through in ``run_family``, one per example in turn, so that every DP size with
idle and uneven ranks (and at each DP size a request drafting into ``max_model_len`` and a preempting KV pool, see
``BOUNDARIES``), every graph mode, every K, a prompt longer than the budget, a sampled request, every acceptance
pattern and every capacity (the budget with a given step cost and with the one it measures) is tried within the
first examples of a cell, not where the draw happens to land (everything else is still drawn). The backend's
code-path options (``PATH_OPTIONS``) are cycled over whole rounds of these values, so every value meets every
option combination within ``cycle_length`` examples."""


def cycle_length(family: str, paths: Mapping[str, tuple[Any, ...]]) -> int:
    """Examples after which every axis value of ``family`` has met every combination of the code-path options."""
    return len(AXES[family]) * len(option_combinations(paths))


@st.composite
@no_type_check
def _requests(
    draw: st.DrawFn,
    dp: int,
    *,
    ranks_drawn: int | None = None,
    max_reqs: int = 3,
    keep_reqs: int | None = None,
    prompt: tuple[int, int] = (1, 8),
    max_tokens: tuple[int, int] = (1, 6),
    sampled: bool = False,
    layout: str = "any",
    force_sampled: bool = False,
    first_prompt_min: int = 0,
    lengthen: bool = False,
    boundary: str = "none",
) -> tuple[tuple[RequestSpec, ...], ...]:
    """Per-rank requests; rank 0 always has one, others may idle, counts differ between ranks.

    The draws do not depend on what is forced, so a cycled axis keeps Hypothesis's
    data generation consistent: ``ranks_drawn`` ranks are drawn and the first
    ``dp`` kept, each with at most ``keep_reqs`` of its requests; ``layout`` (see
    ``LAYOUTS``) makes the last rank idle or its count unlike rank 0's;
    ``force_sampled`` samples rank 0's first request; ``lengthen`` makes its
    prompt at least ``first_prompt_min`` tokens long with tokens drawn for that. ``boundary`` (see
    ``BOUNDARIES``) shapes what is drawn, with no draw of its own: ``max-model-len`` gives every request room for a
    second token (so it drafts after its prefill), ``preempt`` gives rank 0 two long requests (a copy of its first
    when it drew one) that cannot both fit the pool ``family_cases`` sizes for them.
    """
    token = st.integers(0, MODEL.vocab_size - 1)
    ranks = []
    for rank in range(max(dp, ranks_drawn or dp)):
        reqs = []
        for i in range(draw(st.integers(0 if rank else 1, max_reqs))):
            params = SamplingParams(temperature=0.0)
            if sampled:
                chosen = draw(st.booleans())
                sampled_params = SamplingParams(
                    temperature=draw(st.sampled_from([0.5, 1.0])),
                    top_k=draw(st.none() | st.integers(1, 8)),
                    top_p=draw(st.none() | st.sampled_from([0.5, 0.9])),
                )
                params = sampled_params if chosen or (force_sampled and rank == 0 and i == 0) else params
            tokens = tuple(draw(st.lists(token, min_size=prompt[0], max_size=prompt[1])))
            if rank == 0 and i == 0 and first_prompt_min:
                extra = draw(st.lists(token, min_size=first_prompt_min, max_size=first_prompt_min))
                tokens = (tokens + tuple(extra))[: max(len(tokens), first_prompt_min)] if lengthen else tokens
            reqs.append(RequestSpec(f"r{rank}.{i}", tokens, max_tokens=draw(st.integers(*max_tokens)), params=params))
        reqs = reqs[: keep_reqs or None]
        if boundary == "max-model-len":
            reqs = [dataclasses.replace(r, max_tokens=max(r.max_tokens, 2)) for r in reqs]
        elif boundary == "preempt" and rank == 0:
            if len(reqs) == 1:
                reqs.append(dataclasses.replace(reqs[0], req_id="r0.copy", prompt=reqs[0].prompt[::-1]))
            reqs[:2] = [dataclasses.replace(r, max_tokens=PREEMPT_MAX_TOKENS) for r in reqs[:2]]
        if rank == dp - 1 and rank and layout == "idle":
            reqs = []
        elif rank == dp - 1 and rank and layout == "uneven" and len(reqs) == len(ranks[0]):
            reqs = reqs[:-1]
        ranks.append(tuple(reqs))
    return tuple(ranks[:dp])


PREEMPT_MAX_TOKENS = 6
"""Tokens each of rank 0's two requests of a ``preempt`` example generates: both grow past the pool together."""


def _engine(
    budget: int, block_size: int, capture: CaptureConfig, *, num_blocks: int = 96, max_model_len: int = 48
) -> EngineConfig:
    return EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        capture=capture,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len),
    )


def _boundary_engine(
    boundary: str, requests: tuple[tuple[RequestSpec, ...], ...], k: int, block_size: int
) -> dict[str, int]:
    """``_engine``'s pool and model length for a ``dp`` example's boundary (see ``BOUNDARIES``).

    ``max-model-len``: two tokens past the longest prompt, so that request's first drafts (K >= 2) already reach
    the model length, and at least K + 2, so a block drafter's K + 1 queries fit the model (bind refuses less). ``preempt``: the fewest blocks the scheduler admits the largest request with, so rank 0's
    two long requests cannot both fit and one is preempted while the other speculates.
    """
    prompts = [len(r.prompt) for rank in requests for r in rank]
    if boundary == "max-model-len":
        return {"max_model_len": max(max(prompts) + 2, k + 2)}
    if boundary == "preempt":
        longest = max(min(len(r.prompt) + r.max_tokens + k + 1, 48) for rank in requests for r in rank)
        return {"num_blocks": blocks_for(longest, block_size)}
    return {}


@st.composite
@no_type_check
def family_cases(
    draw: st.DrawFn,
    family: str,
    options: Mapping[str, Any] | None = None,
    cycle: int | None = None,
    paths: Mapping[str, tuple[Any, ...]] | None = None,
) -> Case:
    """One example of ``family``; ``options`` are extra backend options fixed for the whole run.

    ``cycle`` (the example's index) takes the family's axis value from ``AXES``
    in turn instead of drawing it, and the combination of the code-path options
    ``paths`` (``axes.path_options``) once per round of axis values; no later draw
    depends on either, so Hypothesis sees the same data generation whatever the
    cycle picks.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown configuration family {family!r}; known: {sorted(FAMILIES)}")
    values = AXES[family]
    combos = option_combinations(paths or {})
    if cycle is None:
        axis = values[draw(st.integers(0, len(values) - 1))]
        combo = combos[draw(st.integers(0, len(combos) - 1))] if len(combos) > 1 else combos[0]
    else:
        axis, combo = values[cycle % len(values)], combos[(cycle // len(values)) % len(combos)]
    base = {**combo, **(options or {})}
    k = draw(st.integers(1, 4))
    dp, mode, acceptance, boundary = 1, CUDAGraphMode.NONE, None, "none"
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    budget = draw(st.integers(8, 32))
    req_kw: dict[str, Any] = {}
    if family == "dp":
        dp, layout, boundary = axis
        keep = 3 if dp <= 2 else 2
        req_kw = {"ranks_drawn": 8, "keep_reqs": keep, "max_tokens": (1, 4), "layout": layout, "boundary": boundary}
        k = max(k, 2) if boundary == "max-model-len" else k  # the first drafts after the prefill reach the limit
    elif family == "graph":
        mode, dp = axis
        sizes = tuple(sorted(draw(st.sets(st.integers(1, 40), min_size=1, max_size=5))))
        req_kw = {"ranks_drawn": 2}
    elif family == "draft-length":
        k, dp = axis
        req_kw = {"ranks_drawn": 2}
    elif family == "chunked-prefill":
        budget = draw(st.integers(3, 10))
        req_kw = {"prompt": (4, 20), "max_reqs": 4, "first_prompt_min": budget + 1, "lengthen": axis == "long"}
    elif family == "acceptance":
        acceptance = axis
        k = draw(st.integers(1, 6))
        req_kw = {"max_tokens": (2, 12)}
    elif family == "sampling":
        req_kw = {"sampled": True, "force_sampled": axis == "sampled"}
    else:  # capacity: the parameters of every choice are drawn, the chosen one's are used
        tau, c0, c1 = draw(st.floats(0.0, 1.0)), draw(st.floats(0.1, 4.0)), draw(st.floats(0.0, 1.0))
        base["capacity"] = "budget" if axis.startswith("budget") else axis  # the measured cost: no c0 and c1 given
        base.update({"threshold": {"tau": tau}, "budget": {"c0": c0, "c1": c1}}.get(axis, {}))
    requests = draw(_requests(dp, **req_kw))
    block_size = draw(st.sampled_from([2, 4, 8]))
    # The engine's K: the caller's K where it fixed one, a lookup's where it drafts past the drafter (lookup_drafts).
    engine_k = max(base.get("num_spec_tokens", k), base.get("lookup_drafts", 0) if base.get("lookup") else 0)
    limits = _boundary_engine(boundary, requests, engine_k, block_size)
    engine = _engine(budget, block_size, CaptureConfig(mode=mode, capture_sizes=sizes), **limits)
    run = DPRunSpec(MODEL, draw(st.integers(0, 3)), engine, requests)
    return Case(family, run, {"num_spec_tokens": k, **base}, acceptance)


# -- a whole family, and the report ------------------------------------------------------------------------------


@dataclass
class FamilyResult:
    """One family in one tensor mode."""

    family: str
    tensor_mode: str
    examples: int = 0
    failures: int = 0
    caught_by: list[str] = field(default_factory=list)
    """Invariant IDs (or ``mismatch`` / exception types) of failing examples, in the order they failed."""
    first_failure: str | None = None
    first_failure_example: int | None = None
    """1-based index of the first failing example (None for a failure of the whole family, ``unchecked-forwards``)."""
    evaluations: dict[str, int] = field(default_factory=dict)
    """Invariant evaluations per step kind in the backend's runs (and replays), every subject together."""
    draft_forward_evaluations: dict[str, int] = field(default_factory=dict)
    """Of those, the checks of draft forwards, per draft step kind: zero for a drafter that drafted fails the family."""
    declared_step_kinds: list[str] = field(default_factory=list)
    drafted: int = 0
    """Drafts the engine verified over the family's examples."""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of this process over the cell (all its threads): the cost, whatever else shares the machine."""
    skipped: str | None = None
    axes_reached: dict[str, list[Any]] = field(default_factory=dict)
    """Per axis, the values its examples configured or ran into (``axes.AxesReached``)."""
    axes_missing: dict[str, list[Any]] = field(default_factory=dict)
    """Per named axis, the values never reached: a family that misses any fails as ``axes-unreached``."""
    axes_judged: bool = False
    """Whether the family ran a whole ``cycle_length`` of examples, after which every named axis must be reached."""
    repro: str | None = None
    """A one-line command that reruns the first failure (the failing example alone, or the whole family)."""

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.failures == 0

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("passed" if self.passed else "failed")


@dataclass
class ConformanceReport:
    backend: str
    results: list[FamilyResult]

    @property
    def ok(self) -> bool:
        return all(r.passed or r.skipped for r in self.results)

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.results)

    @property
    def violated(self) -> list[str]:
        return sorted({c for r in self.results for c in r.caught_by})

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "ok": self.ok,
            "examples": self.examples,
            "results": [dataclasses.asdict(r) | {"status": r.status} for r in self.results],
        }


def run_family(
    factory: Factory,
    family: str,
    *,
    examples: int,
    tensor_mode: str = "cpu",
    seed: int = 0,
    stop_at_first_failure: bool = False,
    options: Mapping[str, Any] | None = None,
    on_example: Callable[[FamilyResult], None] | None = None,
    timeout_s: float = 20.0,
    example: int | None = None,
    backend: str | None = None,
    judge_axes: bool | None = None,
) -> FamilyResult:
    """Up to ``examples`` generated configurations of one family, reproducible from ``seed``.

    ``example`` (1-based) runs that generated example alone: the ones before it
    are drawn, not run, so it is the configuration a full run met at that index.
    ``backend`` names the factory in the failure's ``repro`` command (default:
    its ``module:qualname``). ``judge_axes`` fails a family that ran a whole
    cycle without reaching every named axis value; None judges unless
    ``stop_at_first_failure`` (a mutation run hunts one bug and claims no coverage).
    """
    result = FamilyResult(family, tensor_mode)
    if tensor_mode not in TENSOR_MODES:
        raise ValueError(f"unknown tensor mode {tensor_mode!r}; known: {TENSOR_MODES}")
    if example is not None and example < 1:
        raise ValueError(f"example is a 1-based index of a generated example, got {example}")
    if tensor_mode == "cuda" and not torch.cuda.is_available():
        result.skipped = "no CUDA device"
        return result
    if family == "capacity" and not names_option(factory, "capacity"):
        result.skipped = "the backend takes no `capacity` option"
        return result
    if family == "capacity" and tensor_mode == "fake-cuda":
        # Truncating capacities decide from device values and the scheduler needs the counts on the host: one
        # device-to-host copy per step by design, which a data-less replay cannot make.
        result.skipped = "capacities are data-dependent (one host read of the counts per step by design)"
        return result
    start, cpu_start = time.perf_counter(), time.process_time()
    paths = path_options(factory, options)
    name = backend or _importable_name(factory)

    class _Stop(Exception):
        pass

    stopped: list[bool] = []
    generated: list[int] = []
    coverage = ForwardCoverage()
    reached = AxesReached()

    @settings(
        max_examples=example or examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis.seed(seed)
    @given(st.data())
    def explore(data: st.DataObject) -> None:
        # Hypothesis replays the failing example once more before raising: the same draw, and not a new example.
        case = data.draw(family_cases(family, options, cycle=len(generated) - len(stopped), paths=paths), label="case")
        if stopped:
            raise _Stop
        generated.append(1)
        index = len(generated)
        if example is not None and index != example:
            return  # drawn only: the generation up to ``example`` is a full run's
        result.examples += 1
        outcome = run_case(
            factory, case, tensor_mode=tensor_mode, timeout_s=timeout_s, coverage=coverage, reached=reached
        )
        if not outcome.ok:
            result.failures += 1
            result.caught_by.append(outcome.caught_by or "?")
            if result.first_failure is None:
                result.first_failure = f"{outcome.caught_by}: {outcome.message}\n  example: {case.describe()}"
                result.first_failure_example = index
                result.repro = repro_command(name, family, tensor_mode, seed, example=index, options=options)
            if stop_at_first_failure:
                stopped.append(True)
                raise _Stop
        if on_example is not None:
            on_example(result)
        if example is not None:
            stopped.append(True)
            raise _Stop

    with contextlib.suppress(_Stop):
        explore()
    _judge_coverage(result, coverage)
    judge = not stop_at_first_failure if judge_axes is None else judge_axes
    if judge and example is None and not stopped:
        _judge_axes(result, reached, required_axes(family, AXES[family], paths), cycle_length(family, paths))
    else:
        result.axes_reached = reached.as_dict()
    if result.failures and result.repro is None:  # a failure of the whole family: rerun the whole family
        result.repro = repro_command(name, family, tensor_mode, seed, examples=result.examples, options=options)
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = time.process_time() - cpu_start
    return result


def _importable_name(factory: Factory) -> str | None:
    """``module:qualname`` when that finds ``factory`` again in a new process (``backend_registry.load_factory``)."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    return f"{module}:{qualname}"


def repro_command(
    backend: str | None,
    family: str,
    tensor_mode: str,
    seed: int,
    *,
    example: int | None = None,
    examples: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> str:
    """The one-line ``specdec matrix`` command that reruns one failing example (or a whole family)."""
    which = f"--example {example}" if example is not None else f"--examples {examples}"
    command = (
        f"specdec matrix -b {shlex.quote(backend or '<module:factory>')} --families {family} "
        f"--tensor-modes {tensor_mode} --seed {seed} {which} --workers 1"
    )
    if backend is None:
        command += "  # your factory is not importable by name: pass it as module:factory"
    if options:
        command += f"  # plus the fixed backend options {dict(options)} (run_family(..., options=...))"
    return command


def _judge_axes(result: FamilyResult, reached: AxesReached, required: dict[str, set[Any]], cycle: int) -> None:
    """Record what the family reached; fail it where a whole cycle of examples missed a named axis value."""
    result.axes_reached = reached.as_dict()
    result.axes_judged = result.examples >= cycle
    if not result.axes_judged:
        return
    result.axes_missing = reached.missing(required)
    if not result.axes_missing:
        return
    result.failures += 1
    result.caught_by.append(AXES_UNREACHED)
    if result.first_failure is None:
        missing = "; ".join(f"axis {axis!r} never reached {values}" for axis, values in result.axes_missing.items())
        result.first_failure = (
            f"{AXES_UNREACHED}: over {result.examples} examples (a full cycle is {cycle}) {missing}. The generated "
            "configurations did not take these code paths, so a pass says nothing about them: check that the "
            "backend accepts the options and that its runs reach the model length and preempt as configured"
        )


def _judge_coverage(result: FamilyResult, coverage: ForwardCoverage) -> None:
    """Copy the family's evidence into ``result``; fail it where the backend drafted but no forward was checked."""
    result.evaluations = coverage.evaluations
    result.draft_forward_evaluations = coverage.draft_forward_evaluations
    result.declared_step_kinds = sorted(coverage.declared_step_kinds)
    result.drafted = coverage.drafted
    unchecked = coverage.unchecked()
    if unchecked is None:
        return
    result.failures += 1
    result.caught_by.append(UNCHECKED_FORWARDS)
    if result.first_failure is None:
        result.first_failure = f"{UNCHECKED_FORWARDS}: {unchecked}\n  over all {result.examples} examples"


def check_backend(
    factory: Factory,
    *,
    name: str | None = None,
    families: Sequence[str] | None = None,
    examples: int | Mapping[str, int] = 50,
    tensor_modes: Sequence[str] = TENSOR_MODES,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    stop_at_first_failure: bool = False,
    on_example: Callable[[FamilyResult], None] | None = None,
) -> ConformanceReport:
    """Run the conformance suite against ``factory`` and return a structured report (never raises on findings)."""
    chosen = list(families) if families is not None else list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown configuration families {unknown}; known: {sorted(FAMILIES)}")
    results = []
    for tensor_mode in tensor_modes:
        for family in chosen:
            n = examples if isinstance(examples, int) else examples.get(family, 50)
            results.append(
                run_family(
                    factory,
                    family,
                    examples=n,
                    tensor_mode=tensor_mode,
                    seed=seed,
                    stop_at_first_failure=stop_at_first_failure,
                    options=options,
                    on_example=on_example,
                )
            )
    return ConformanceReport(name or str(getattr(factory, "__name__", repr(factory))), results)


def build(factory: Factory, **options: Any) -> Speculator:
    """Build a backend on the matrix's target (for smoke checks before a long run)."""
    return factory(Transformer(MODEL, seed=0), **options)
