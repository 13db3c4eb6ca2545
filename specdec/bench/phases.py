"""``specdec bench-phases``: where a decoding step's time goes, per runner, on a real model.

``specdec bench`` says how fast each backend is; this says why. Every engine
step's wall time is split into the target's forward (a decode row for plain
decoding, K + 1 verify rows for a backend), its LM head over the rows the
engine samples or verifies, the drafter's proposal (or, on a step where nobody
drafts, its ``take_context``), the draft-length policy's decision (``adaptive``
and ``idle``: it runs on every step) and the rest of the engine (scheduling,
verification, bookkeeping). Rounds alternate the runner order
like the bench. The break-even tau of a backend is its step time over plain
decoding's: a drafter below it makes decoding slower.

Each backend can run under several draft lengths side by side: ``fixed`` (K
drafts every step, the cost of drafting), ``adaptive`` (the engine's policy,
what ``specdec bench`` measures) and ``idle`` (a policy that never drafts, so
every step is a plain step plus whatever the drafter does to keep up: the
floor of the adaptive policy's cost where drafting does not pay).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.bench.options import DEFAULT_BACKENDS
from specdec.draft_decisions import NO_DRAFTS
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import DRAFT_LENGTHS as ENGINE_DRAFT_LENGTHS
from specdec.metrics import SpeculationCounters
from specdec.nn.packed_linear import fp32_kernel_choice
from specdec.shadow_drafts import FreeDraft
from specdec.speculator import ContextTaker

PLAIN = "plain"
DRAFT_LENGTHS = (*ENGINE_DRAFT_LENGTHS, "idle")
"""The engine's draft lengths, and ``idle``: the adaptive engine under a policy that never drafts."""


class DraftNothing(DraftLengthPolicy):
    """The ``idle`` draft length: every request at 0 drafts on every step, probes included.

    What is left of a backend's step time over plain decoding's is the price of
    having it there at all, which the adaptive policy pays wherever drafting
    does not pay.
    """

    def choose(
        self,
        req_ids: Sequence[str],
        *,
        base_rows: int,
        remaining: Mapping[str, int] | None = None,
        draining: bool = False,
        sources: Mapping[str, str] | None = None,
        limits: Mapping[str, int] | None = None,
        free_drafts: Mapping[str, FreeDraft] | None = None,
    ) -> dict[str, int]:
        del base_rows, remaining, draining, sources, limits, free_drafts
        self.decisions += 1
        self.last_decision = NO_DRAFTS
        return dict.fromkeys(req_ids, 0)


def draft_policy(draft_length: str, num_spec_tokens: int) -> DraftLengthPolicy | None:
    """The policy a runner keeps over all its runs (``None``: a fixed K), as a server keeps one across requests."""
    if draft_length == "fixed":
        return None
    if draft_length == "adaptive":
        return DraftLengthPolicy(num_spec_tokens)
    if draft_length == "idle":
        return DraftNothing(num_spec_tokens)
    raise ValueError(f"draft length must be one of {', '.join(DRAFT_LENGTHS)}, got {draft_length!r}")


def runner_name(backend: str, draft_length: str) -> str:
    return backend if draft_length == "fixed" else f"{backend}/{draft_length}"


@dataclass
class PhaseTimes:
    """Seconds per phase over one run of a runner on every prompt.

    ``steps``, ``wall``, ``target`` and ``propose`` cover decode steps only: a
    step that prefills a prompt (a forward over hundreds of rows) is counted in
    ``prefill_steps`` and ``prefill_wall``, whole. Spread over the decode steps,
    a prefill made a backend's verify forward look 3-6 ms dearer than plain
    decoding's 1-row forward, since a backend has fewer steps to spread it over.
    Throughput (``total_wall``) includes the prefill, as ``specdec bench`` does.
    """

    steps: int = 0
    wall: float = 0.0
    target: float = 0.0
    lm_head: float = 0.0
    """The target's LM head (``compute_logits``) outside a proposal: vocabulary-wide, 10% of a float32 decode step."""
    propose: float = 0.0
    decide: float = 0.0
    """In the draft-length policy's choice (``adaptive``, ``idle``): a host cost every step pays, drafting or not."""
    tokens: int = 0
    prefill_steps: int = 0
    prefill_wall: float = 0.0
    speculation: SpeculationCounters = field(default_factory=SpeculationCounters)
    open_phases: list[str] = field(default_factory=list, repr=False, compare=False)
    """The timed phases a call is inside now (``timed``), so a phase met inside another is not counted twice."""

    @property
    def rest(self) -> float:
        return self.wall - self.target - self.lm_head - self.propose - self.decide

    @property
    def total_wall(self) -> float:
        return self.wall + self.prefill_wall


@dataclass
class RunnerPhases:
    name: str
    rounds: list[PhaseTimes] = field(default_factory=list)

    def per_step_ms(self, attr: str) -> float:
        """Median over rounds of ``attr`` per decode step (NaN when no round had one)."""
        per_round = [1000 * getattr(r, attr) / r.steps for r in self.rounds if r.steps]
        return statistics.median(per_round) if per_round else float("nan")

    @property
    def prefill_ms(self) -> float:
        """Median over rounds of the wall time of a step that prefills."""
        per_round = [1000 * r.prefill_wall / r.prefill_steps for r in self.rounds if r.prefill_steps]
        return statistics.median(per_round) if per_round else float("nan")

    @property
    def speculation(self) -> SpeculationCounters:
        """The counts of every round together (an adaptive policy's choices differ between rounds)."""
        total = SpeculationCounters()
        for r in self.rounds:
            total.add(r.speculation)
        return total

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(r.tokens / r.total_wall for r in self.rounds)

    def speedup_over(self, plain: RunnerPhases) -> float:
        """Median over rounds of tokens/s against plain decoding's in the same round."""
        if len(self.rounds) != len(plain.rounds):
            raise ValueError(f"{self.name} ran {len(self.rounds)} rounds, {plain.name} {len(plain.rounds)}")
        return statistics.median(
            (r.tokens / r.total_wall) / (p.tokens / p.total_wall)
            for r, p in zip(self.rounds, plain.rounds, strict=True)
        )

    @property
    def drafts_per_step(self) -> float:
        return self.speculation.drafted / sum(r.steps for r in self.rounds)


def timed(fn: Callable[..., Any], times: PhaseTimes, attr: str, *, not_within: str | None = None) -> Callable[..., Any]:
    """``fn`` that adds its wall time to ``times.<attr>``, except in a call made within the phase ``not_within``
    (a drafter scoring the target's whole LM head: that time is the proposal's)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not_within is not None and not_within in times.open_phases:
            return fn(*args, **kwargs)
        times.open_phases.append(attr)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(times, attr, getattr(times, attr) + time.perf_counter() - start)
            times.open_phases.pop()

    return wrapper


@contextlib.contextmanager
def timing_calls(
    owner: object, name: str, times: PhaseTimes, attr: str, *, not_within: str | None = None
) -> Iterator[None]:
    """``owner.<name>`` timed into ``times.<attr>`` (``timed``) inside the block, then as it was: the owner's own
    attribute put back, or the class's method again, so the next run times afresh."""
    own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, timed(original, times, attr, not_within=not_within))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def run_phases(
    target: Any,
    prompts: Sequence[Sequence[int]],
    make_speculator: Callable[[], Any],
    *,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    batch_size: int = 1,
    temperature: float = 0.0,
    policy: DraftLengthPolicy | None = None,
) -> PhaseTimes:
    """Decoding of the prompts in batches of ``batch_size`` (1: each alone); decode steps' phases timed, prefill apart.

    Sampled runs (``temperature`` above 0) seed each request by its index, so
    every runner and round draws from the same generators. ``policy``: the
    adaptive draft length's policy, continued by every batch's engine (``None``:
    K drafts every step).
    """
    from specdec.bench.runner import batch_engine
    from specdec.sampling import SamplingParams

    times = PhaseTimes()
    with contextlib.ExitStack() as timing:
        timing.enter_context(timing_calls(target, "forward", times, "target"))
        timing.enter_context(timing_calls(target, "compute_logits", times, "lm_head", not_within="propose"))
        if policy is not None:
            timing.enter_context(timing_calls(policy, "choose", times, "decide"))
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            speculator = make_speculator()
            if speculator is not None:
                speculator.propose = timed(speculator.propose, times, "propose")
                if isinstance(speculator, ContextTaker):  # a step where nobody drafts: the drafter's work all the same
                    speculator.take_context = timed(speculator.take_context, times, "propose")  # type: ignore[method-assign]
            engine = batch_engine(target, [len(p) for p in batch], max_tokens, speculator, seed=0, draft_policy=policy)
            requests = [
                engine.add_request(
                    str(first + i),
                    list(prompt),
                    params=SamplingParams(temperature=temperature),
                    max_tokens=max_tokens,
                    stop_token_ids=stop_token_ids,
                    seed=first + i if temperature > 0 else None,
                )
                for i, prompt in enumerate(batch)
            ]
            with torch.inference_mode():
                while engine.has_work:
                    prefill = any(r.in_prefill for r in requests if r.finish_reason is None)
                    before = (times.target, times.lm_head, times.propose, times.decide)
                    start = time.perf_counter()
                    engine.step()
                    took = time.perf_counter() - start
                    if prefill:  # counted whole, apart from the decode steps' phases
                        times.target, times.lm_head, times.propose, times.decide = before
                        times.prefill_wall += took
                        times.prefill_steps += 1
                    else:
                        times.wall += took
                        times.steps += 1
            times.tokens += sum(len(r.output) for r in requests)
            times.speculation.add(engine.metrics)
    return times


def report(runners: Sequence[RunnerPhases]) -> str:
    """A markdown table: ms per step by phase, drafts, tau, tokens/s against plain's, and the break-even tau."""
    plain = next(r for r in runners if r.name == PLAIN)
    base = plain.per_step_ms("wall")
    lines = [
        "| runner | ms per step | target forward | LM head | proposal | decision | engine rest | drafts per step | tau "
        "| prefill ms | tokens/s | vs plain | break-even tau |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runners:
        wall = r.per_step_ms("wall")
        if r.name == PLAIN:
            propose = decide = drafts = tau = even = "-"
        else:
            propose, drafts = f"{r.per_step_ms('propose'):.1f}", f"{r.drafts_per_step:.2f}"
            decide = f"{r.per_step_ms('decide'):.2f}"
            tau = f"{r.speculation.acceptance_length:.2f}" if r.speculation.drafted else "-"
            even = f"{wall / base:.2f}"
        lines.append(
            f"| {r.name} | {wall:.1f} | {r.per_step_ms('target'):.1f} | {r.per_step_ms('lm_head'):.1f} | {propose} "
            f"| {decide} | {r.per_step_ms('rest'):.1f} "
            f"| {drafts} | {tau} | {r.prefill_ms:.1f} | {r.tokens_per_s:.1f} | {r.speedup_over(plain):.3f} | {even} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.bench.options import add_verify_attention_option
    from specdec.bench.suites import SUITES
    from specdec.cli.argtypes import LIST_HELP, add_backends_option, float_in, list_of, positive_int
    from specdec.cli.backend_options import add_backend_option

    p.add_argument("--model", default="smollm2-135m-instruct", help="the target (default: smollm2-135m-instruct)")
    add_backends_option(p, f"backends {LIST_HELP}; plain is always run (default: {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--suite", default="humaneval", choices=SUITES, help="prompt suite (default: humaneval)")
    p.add_argument(
        "--prompts",
        type=positive_int,
        default=4,
        help="the suite's first bench prompts, decoded in batches of --batch-size (default: 4)",
    )
    p.add_argument("-k", "--num-spec-tokens", type=positive_int, default=4, help="draft tokens per step (default: 4)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument(
        "--draft-length",
        dest="draft_lengths",
        action="extend",
        type=list_of(choices=DRAFT_LENGTHS),
        help=f"each backend runs under each of these {LIST_HELP}: fixed (K every step), adaptive (the engine's "
        "policy, as in bench), idle (never drafts: what an idle drafter costs) (default: fixed)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="rounds, runner order reversed every other round (default: 2)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the target's dtype (default: float32, as in every command)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="prompts decoded together in one engine; 1 runs each alone (default: 1)",
    )
    p.add_argument(
        "--temperature",
        type=float_in(0.0),
        default=0.0,
        help="0 is greedy; above 0 each request samples with its own seed (default: 0)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bf16: a request's logits do not depend on its batch (as bench --batch-invariant)",
    )
    add_verify_attention_option(p)
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--full-vocab", action="store_true", help="drafters score the whole LM head")
    add_backend_option(
        p, "an option for every backend whose factory takes KEY, e.g. -O lookup=3 (repeatable, as in bench)"
    )


def run(args: argparse.Namespace) -> int:
    import contracts
    from specdec.backend_registry import create, names_option
    from specdec.bench.options import configure_target
    from specdec.bench.suites import corpus_prompts, encode
    from specdec.cli.backend_options import refused, shared_among
    from specdec.cli.errors import UsageError, check_backend, check_model
    from specdec.hub import load

    check_model(args.model)
    backends = list(DEFAULT_BACKENDS) if args.backends is None else args.backends
    for name in backends:
        if name == PLAIN:
            raise UsageError(f"{PLAIN!r} always runs as the baseline; list only backends in --backends")
        check_backend(name)
    if any(key == "pretrained" for key, _ in args.backend_option or ()):
        raise UsageError("-O pretrained: bench-phases always runs the shipped drafter weights")
    shared = shared_among(args.backend_option, backends, args.num_spec_tokens)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contracts.set_mode("off")
    target, tokenizer = load(args.model, dtype=getattr(torch, args.dtype))
    try:
        configure_target(target, batch_invariant=args.batch_invariant, verify_attention=args.verify_attention)
    except ValueError as exc:
        raise UsageError(f"--batch-invariant: {exc}") from None
    prompts = [encode(tokenizer, p) for p in corpus_prompts(args.suite)[: args.prompts]]
    lengths = list(dict.fromkeys(args.draft_lengths or ["fixed"]))

    def factory(name: str) -> Callable[[], Any]:
        if name == PLAIN:
            return lambda: None
        options: dict[str, Any] = {"num_spec_tokens": args.num_spec_tokens, **shared[name]}
        if names_option(name, "pretrained"):
            options["pretrained"] = args.model
        if args.full_vocab:
            options["full_vocab"] = True
        return lambda: create(name, target, **options)

    ks: dict[str, int] = {}
    for name in backends:  # each factory sees its -O values once here, so a refusal is reported as the user's
        try:
            # The speculator's own K: a lookup drafting past the model's (-O lookup_drafts) raises it.
            ks[name] = factory(name)().num_spec_tokens
        except (TypeError, ValueError) as exc:
            if not shared[name]:
                raise  # no -O value of the user's to blame: a bug
            raise refused(shared[name], exc, name) from None

    setups = {PLAIN: (factory(PLAIN), None)} | {
        runner_name(b, length): (factory(b), draft_policy(length, ks[b])) for b in backends for length in lengths
    }
    names = list(setups)
    runners = {n: RunnerPhases(n) for n in names}
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            make, policy = setups[name]
            runners[name].rounds.append(
                run_phases(
                    target,
                    prompts,
                    make,
                    max_tokens=args.max_tokens,
                    stop_token_ids=tokenizer.stop_token_ids,
                    batch_size=args.batch_size,
                    temperature=args.temperature,
                    policy=policy,
                )
            )
    print(
        f"{args.model} in {args.dtype}"
        + (f" ({fp32_kernel_choice()})" if args.dtype == "float32" else "")
        + f", {torch.get_num_threads()} thread(s), {args.suite} x {len(prompts)} prompts "
        f"{'alone' if args.batch_size == 1 else f'in batches of {args.batch_size}'}, "
        f"{'greedy' if args.temperature == 0 else f'T = {args.temperature:g}'}, K = {args.num_spec_tokens} "
        f"({', '.join(lengths)}), "
        f"{args.max_tokens} tokens at most; medians of {args.rounds} rounds; per-step columns are decode steps "
        "(a prompt's prefill step apart, in 'prefill ms'); tokens/s and 'vs plain' include the prefill; "
        "break-even tau = decode step time / plain decode step time"
    )
    print(report([runners[n] for n in names]))
    return 0
