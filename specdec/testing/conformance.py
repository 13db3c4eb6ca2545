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
from specdec.dp_group import DPCollectiveTimeout, in_process_world, run_ranks
from specdec.engine import EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import ModelOutput, Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Speculator, TargetStep, check_proposal
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


def run_case(
    factory: Factory,
    case: Case,
    *,
    tensor_mode: str = "cpu",
    mode: str = "full",
    timeout_s: float = 20.0,
    coverage: ForwardCoverage | None = None,
) -> Outcome:
    """Run one configuration on every rank; compare greedy outputs with plain decoding (and replay on fake cuda).

    ``coverage`` gathers what the backend declared and drafted and the
    invariant evaluations of the run and its replay (``forward_coverage``).
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
    return outcome


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
    except ContractViolation as e:
        return Outcome(False, e.invariant_id, str(e)), results
    except DPCollectiveTimeout as e:
        return Outcome(False, "DPCollectiveTimeout", str(e)), results
    except Exception as e:  # a crash is a finding too: report it, do not hide it
        return Outcome(False, type(e).__name__, "".join(traceback.format_exception_only(e)).strip()), results
    if tensor_mode == "fake-cuda":
        by_rank = sorted(recorders, key=lambda r: r.rank)  # rank threads build their recorders in any order
        try:
            with counting():
                replay_on_fake_cuda(factory, case, [r.events for r in by_rank], timeout_s)
        except ContractViolation as e:
            return Outcome(False, e.invariant_id, f"fake-cuda replay: {e}"), results
        except Exception as e:
            message = "fake-cuda replay: " + "".join(traceback.format_exception_only(e)).strip()
            return Outcome(False, type(e).__name__, message), results
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

            def move(t: torch.Tensor) -> torch.Tensor:
                return mode.from_tensor(t).to("cuda")
        else:
            # Meta kernels are Python on this build: compute each distinct call once (``meta_memo``).
            stack.enter_context(MetaMemo())

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
    "dp": tuple((dp, LAYOUTS[i % 3]) for i, dp in enumerate((1, 2, 4, 8) * 3)),
    "graph": tuple((mode, (1, 2)[i % 2]) for i, mode in enumerate(tuple(CUDAGraphMode) * 2)),
    "draft-length": tuple((k, dp) for dp in (1, 2) for k in range(1, 9)),
    "chunked-prefill": ("long", "any"),
    "acceptance": ("all-accept", "all-reject", "random"),
    "sampling": ("sampled", "any"),
    "capacity": ("threshold", "budget", "full"),
}
"""The values each family cycles through in ``run_family``, one per example in turn, so that every DP size with
idle and uneven ranks, every graph mode, every K, a prompt longer than the budget, a sampled request, every
acceptance pattern and every capacity is tried within the first examples of a cell, not where the draw happens
to land (everything else is still drawn)."""


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
) -> tuple[tuple[RequestSpec, ...], ...]:
    """Per-rank requests; rank 0 always has one, others may idle, counts differ between ranks.

    The draws do not depend on what is forced, so a cycled axis keeps Hypothesis's
    data generation consistent: ``ranks_drawn`` ranks are drawn and the first
    ``dp`` kept, each with at most ``keep_reqs`` of its requests; ``layout`` (see
    ``LAYOUTS``) makes the last rank idle or its count unlike rank 0's;
    ``force_sampled`` samples rank 0's first request; ``lengthen`` makes its
    prompt at least ``first_prompt_min`` tokens long with tokens drawn for that.
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
        if rank == dp - 1 and rank and layout == "idle":
            reqs = []
        elif rank == dp - 1 and rank and layout == "uneven" and len(reqs) == len(ranks[0]):
            reqs = reqs[:-1]
        ranks.append(tuple(reqs))
    return tuple(ranks[:dp])


def _engine(budget: int, block_size: int, capture: CaptureConfig) -> EngineConfig:
    return EngineConfig(
        num_blocks=96,
        block_size=block_size,
        capture=capture,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=48),
    )


@st.composite
@no_type_check
def family_cases(
    draw: st.DrawFn, family: str, options: Mapping[str, Any] | None = None, cycle: int | None = None
) -> Case:
    """One example of ``family``; ``options`` are extra backend options fixed for the whole run.

    ``cycle`` (the example's index) takes the family's axis value from ``AXES``
    in turn instead of drawing it; no later draw depends on the axis value, so
    Hypothesis sees the same data generation whatever the cycle picks.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown configuration family {family!r}; known: {sorted(FAMILIES)}")
    values = AXES[family]
    axis = values[draw(st.integers(0, len(values) - 1)) if cycle is None else cycle % len(values)]
    base = dict(options or {})
    k = draw(st.integers(1, 4))
    dp, mode, acceptance = 1, CUDAGraphMode.NONE, None
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    budget = draw(st.integers(8, 32))
    req_kw: dict[str, Any] = {}
    if family == "dp":
        dp, layout = axis
        keep = 3 if dp <= 2 else 2
        req_kw = {"ranks_drawn": 8, "keep_reqs": keep, "max_tokens": (1, 4), "layout": layout}
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
        base["capacity"] = axis
        base.update({"threshold": {"tau": tau}, "budget": {"c0": c0, "c1": c1}}.get(axis, {}))
    requests = draw(_requests(dp, **req_kw))
    engine = _engine(budget, draw(st.sampled_from([2, 4, 8])), CaptureConfig(mode=mode, capture_sizes=sizes))
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
) -> FamilyResult:
    """Up to ``examples`` generated configurations of one family, reproducible from ``seed``."""
    result = FamilyResult(family, tensor_mode)
    if tensor_mode not in TENSOR_MODES:
        raise ValueError(f"unknown tensor mode {tensor_mode!r}; known: {TENSOR_MODES}")
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

    class _Stop(Exception):
        pass

    stopped: list[bool] = []
    coverage = ForwardCoverage()

    @settings(
        max_examples=examples,
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
        case = data.draw(family_cases(family, options, cycle=result.examples - len(stopped)), label="case")
        if stopped:
            raise _Stop
        result.examples += 1
        outcome = run_case(factory, case, tensor_mode=tensor_mode, timeout_s=timeout_s, coverage=coverage)
        if not outcome.ok:
            result.failures += 1
            result.caught_by.append(outcome.caught_by or "?")
            if result.first_failure is None:
                result.first_failure = f"{outcome.caught_by}: {outcome.message}\n  example: {case.describe()}"
                result.first_failure_example = result.examples
            if stop_at_first_failure:
                stopped.append(True)
                raise _Stop
        if on_example is not None:
            on_example(result)

    with contextlib.suppress(_Stop):
        explore()
    _judge_coverage(result, coverage)
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = time.process_time() - cpu_start
    return result


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
