"""Speculation counters, and the request and run metrics built on them.

One request, one engine run, one bench record and one bench-phases round all
count the same things: how many drafts were proposed and accepted, how many
verify steps ran and how many tokens they emitted, by draft position too.
``SpeculationCounters`` holds those counts and derives tau and the acceptance
rates from them in one place, so the figures of a request, a run and a
benchmark cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from specdec.request import Request

_Counters = TypeVar("_Counters", bound="SpeculationCounters")


@dataclass
class SpeculationCounters:
    """Drafts proposed and accepted, verify steps and the tokens they emitted, in total and by draft position.

    ``emitted_in_verify`` counts only the tokens that reached the output: a
    verify that accepted drafts past a stop token or ``max_tokens`` adds fewer
    than ``accepted + 1``. ``accepted``/``drafted`` (and the rates by position)
    stay the verifier's, a measure of the drafter.
    """

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted_in_verify: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Count one verify step that checked ``num_drafted`` drafts, accepted the first ``num_accepted``."""
        self.verify_steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.emitted_in_verify += num_emitted
        self._widen(num_drafted)
        for k in range(num_drafted):
            self.drafted_by_position[k] += 1
            if k < num_accepted:
                self.accepted_by_position[k] += 1

    def add(self, other: SpeculationCounters) -> None:
        """Add ``other``'s counts to these (a request into a run, a run into a benchmark total)."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verify_steps += other.verify_steps
        self.emitted_in_verify += other.emitted_in_verify
        self._widen(len(other.drafted_by_position))
        for k, (a, d) in enumerate(zip(other.accepted_by_position, other.drafted_by_position, strict=True)):
            self.drafted_by_position[k] += d
            self.accepted_by_position[k] += a

    def _widen(self, positions: int) -> None:
        grow = positions - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)

    @property
    def acceptance_length(self) -> float:
        """Tau: mean tokens emitted per verify step (0.0 before the first)."""
        return self.emitted_in_verify / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        """Accepted over drafted at each draft position (0.0 where nothing was drafted)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)]

    def counts(self) -> dict[str, Any]:
        """The counts as JSON-ready fields (copies of the lists), in the bench JSON's key order."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "emitted_in_verify": self.emitted_in_verify,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
        }

    def snapshot(self) -> SpeculationCounters:
        """The counts alone, detached from this object (a run's totals kept after the engine is gone)."""
        return SpeculationCounters(**self.counts())

    def copy(self: _Counters) -> _Counters:
        """Every field, detached from this object: what ``restore`` puts back if a step that counted fails."""
        # Taken for every request of every step, so the fields are copied directly (``replace`` is twice as slow).
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.accepted_by_position = list(self.accepted_by_position)
        twin.drafted_by_position = list(self.drafted_by_position)
        return twin

    def restore(self: _Counters, saved: _Counters) -> None:
        """Set every field back to ``saved``'s (an earlier ``copy``), in place: holders of this object see it too."""
        for f in dataclasses.fields(self):
            value = getattr(saved, f.name)
            setattr(self, f.name, list(value) if isinstance(value, list) else value)


@dataclass
class RequestMetrics(SpeculationCounters):
    """One request's speculation counts, and how often the scheduler preempted it."""

    preemptions: int = 0


@dataclass
class RunMetrics(SpeculationCounters):
    """An engine run's totals: the speculation counts of its finished requests, and its steps and tokens."""

    steps: int = 0
    tokens_emitted: int = 0
    tokens_scheduled: int = 0
    wall_s: float = 0.0
    decisions: str = ""
    """The adaptive draft length's decisions, one character per step that decided (``specdec.draft_decisions``);
    empty at a fixed length."""

    @property
    def tokens_per_step(self) -> float:
        return self.tokens_emitted / self.steps if self.steps else 0.0

    def add_request(self, req: Request) -> None:
        """Fold a finished request's speculation counts into the run's."""
        self.add(req.metrics)
