"""Undoing an engine step that raised, so that a failure never leaves half a step behind.

A step changes, phase after phase, the scheduler's queues, the target and draft
KV caches, each request's tokens, finish state and counts, the drafter's own
state, and the engine's counters and random stream. Not all of it can be put
back exactly: a drafter's private state is its own, and a preemption may hand a
block to another request whose forward then overwrites it. So a failed step is
undone by recomputation. What a caller sees is as before the step: every
request's tokens, finish state and speculation counts, the run's counters and
the sampling generator's state. What the step may have touched underneath is
dropped: every request it had running gives up its target KV, its draft-cache
entries and the drafter's state for it, and waits, first in line, to be
recomputed from its tokens, as after a preemption (not counted as one).

The undo ends by checking that no cache holds a block any more. If the undo
itself fails, or the engine is one rank of a DP group (its peers cannot undo
their part of the step), the engine refuses further steps with an
``EngineFailedError`` naming the original failure and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.kv_cache import KVCacheManager
from specdec.metrics import RequestMetrics, RunMetrics
from specdec.request import FinishReason, Request
from specdec.scheduler import Scheduler
from specdec.speculator import DraftContext, Speculator

STEP_PHASES = ("schedule", "DP sync", "target forward", "verify", "commit", "propose", "finish")
"""The phases of ``Engine.step`` in order, as failures name them."""

_MAX_QUOTED = 300
"""How much of a failure's message an ``EngineFailedError`` quotes (the original stays its ``__cause__``)."""


class EngineFailedError(RuntimeError):
    """The engine refuses to step: an earlier step failed and the engine cannot go on consistently."""


class StepUndoError(RuntimeError):
    """Undoing a failed step did not leave the caches empty: some block is still held after every request let go."""


@dataclass(frozen=True)
class _Before:
    """A request's visible state before the step first changed it."""

    num_output: int
    finish_reason: FinishReason | None
    metrics: RequestMetrics


class StepJournal:
    """What one step is about to change that a caller can see, recorded before each change so ``undo_step`` can put it back."""

    def __init__(self, step: int, running: Iterable[Request], metrics: RunMetrics) -> None:
        self.step = step
        """The step's number, counting from 1 (the run's finished steps plus one)."""
        self.phase = STEP_PHASES[0]
        self.running = list(running)
        """The scheduler's running requests when the step began (those it preempts included)."""
        self.preemptions = [req.metrics.preemptions for req in self.running]
        self.metrics = metrics.copy()
        self.touched: dict[Request, _Before] = {}
        self.generator: tuple[torch.Generator, Tensor] | None = None

    def enter(self, phase: str) -> None:
        if phase not in STEP_PHASES:
            raise ValueError(f"unknown step phase {phase!r}; the phases are {STEP_PHASES}")
        self.phase = phase

    def touch(self, req: Request) -> None:
        """Record ``req``'s tokens, finish state and counts before the step changes them (once per step)."""
        if req not in self.touched:
            self.touched[req] = _Before(len(req.output), req.finish_reason, req.metrics.copy())

    def save_generator(self, generator: torch.Generator) -> None:
        """Record the state of the generator the step samples with, before it draws."""
        self.generator = (generator, generator.get_state())


def undo_step(
    journal: StepJournal,
    *,
    scheduler: Scheduler,
    requests: dict[str, Request],
    metrics: RunMetrics,
    speculator: Speculator | None,
    draft_ctx: DraftContext | None,
) -> list[Request]:
    """Put back what ``journal`` recorded, requeue every request the step had running and check the caches.

    Returns the requeued requests, first in line now, in their old order.
    """
    for req, before in journal.touched.items():
        del req.output[before.num_output :]
        req.finish_reason = before.finish_reason
        req.metrics = before.metrics
        requests.setdefault(req.req_id, req)
    for req, count in zip(journal.running, journal.preemptions, strict=True):
        req.metrics.preemptions = count  # a preemption in the failed step is undone with it
    affected = list(dict.fromkeys([*journal.running, *journal.touched, *scheduler.running]))
    scheduler.requeue(affected)
    ids = [r.req_id for r in affected]
    if speculator is not None:
        for rid in ids:
            speculator.finish(rid)
    caches = {"the target cache": scheduler.kv}
    if draft_ctx is not None:
        draft_ctx.release(ids)
        caches.update({f"draft cache {name!r}": cache for name, cache in draft_ctx.caches.items()})
    if journal.generator is not None:
        generator, state = journal.generator
        generator.set_state(state)
    metrics.restore(journal.metrics)
    check_nothing_held(caches)
    return affected


def check_nothing_held(caches: dict[str, KVCacheManager]) -> None:
    """After an undo no request holds a block of any cache: every running request was requeued without KV."""
    for name, cache in caches.items():
        held = {r: cache.block_table(r) for r in cache.requests if cache.block_table(r)}
        if held or cache.num_free_blocks != cache.num_blocks:
            raise StepUndoError(
                f"{name} still holds blocks after the failed step was undone: {_quote(repr(held))} "
                f"({cache.num_free_blocks} of {cache.num_blocks} free); a block was lost or booked outside the cache"
            )
        cache.check(live_requests=(), component=name)


def failure_note(journal: StepJournal, recomputed: int) -> str:
    """What the engine tells the caller, on the exception itself, after it undid a step."""
    return (
        f"specdec: engine step {journal.step} failed in its {journal.phase} phase and was undone: every request's "
        f"tokens, finish state and counts, the run's counters and the sampling generator are as before it; the "
        f"{recomputed} request(s) it had running lost their KV and drafter state and will be recomputed from their "
        f"tokens. The engine can keep stepping."
    )


@dataclass(frozen=True)
class Refusal:
    """Why an engine takes no more steps: the failure, and whether its requests are still in a known state."""

    message: str
    cause: BaseException
    consistent: bool
    """True when the step was undone (its requests may be aborted and read); False when the undo failed."""

    def error(self) -> EngineFailedError:
        err = EngineFailedError(self.message)
        err.__cause__ = self.cause
        return err


def undo_failed(journal: StepJournal, exc: BaseException, undo_exc: BaseException) -> Refusal:
    return Refusal(
        f"engine step {journal.step} failed in its {journal.phase} phase ({_describe(exc)}), and undoing it failed "
        f"too ({_describe(undo_exc)}): this engine's requests, KV caches and drafter state may disagree, so it takes "
        f"no more steps. Build a new Engine and add the requests again; engine.requests still holds them, their "
        f"outputs possibly including tokens of the failed step.",
        exc,
        consistent=False,
    )


def dp_step_failed(journal: StepJournal, exc: BaseException, rank: int) -> Refusal:
    return Refusal(
        f"engine step {journal.step} failed in its {journal.phase} phase on DP rank {rank} ({_describe(exc)}). This "
        f"rank undid the step, but the other ranks cannot undo their part of it, so this engine takes no more steps. "
        f"Its requests hold their outputs from before the failed step (take each with engine.abort(req_id)); then "
        f"build a new DP group and a new engine on every rank.",
        exc,
        consistent=True,
    )


def _describe(exc: BaseException) -> str:
    return _quote(f"{type(exc).__name__}: {exc}")


def _quote(text: str) -> str:
    return text if len(text) <= _MAX_QUOTED else f"{text[:_MAX_QUOTED]}... ({len(text)} characters)"
