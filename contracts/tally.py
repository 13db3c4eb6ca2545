"""Counts of invariant evaluations by subject and step kind, kept only while a tally is open.

A run whose checks found no invariant to evaluate looks exactly like a run
whose checks all held. ``check`` reports each call here, so a caller (the
conformance suite) can tell the two apart: a drafter's forwards that met no
invariant show as zero draft-forward evaluations. With no tally open a report
costs one list read.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from contracts.registry import StepKind, Subject, invariants_for


@dataclass(eq=False)
class EvaluationTally:
    """Invariant evaluations per (subject, step kind) while open; ``step_kind`` is whatever a caller passed."""

    counts: Counter[tuple[Subject, object]] = field(default_factory=Counter)

    def by_step_kind(self) -> dict[str, int]:
        """Evaluations per step kind, every subject together."""
        out: Counter[str] = Counter()
        for (_, kind), n in self.counts.items():
            out[_name(kind)] += n
        return dict(sorted(out.items()))

    def of(self, subject: Subject) -> dict[str, int]:
        """Evaluations of one subject's invariants, per step kind."""
        return {_name(kind): n for (s, kind), n in sorted(self.counts.items(), key=repr) if s is subject}


def _name(kind: object) -> str:
    return kind.value if isinstance(kind, StepKind) else repr(kind)


_OPEN: list[EvaluationTally] = []
_LOCK = threading.Lock()  # in-process DP ranks are threads that check at once


def record(subject: Subject, step_kind: StepKind, full: bool) -> None:
    """One ``check`` call: the invariants it runs for ``subject`` at ``step_kind`` (``full``: value checks too)."""
    if not _OPEN:
        return
    n = sum(1 for inv in invariants_for(subject, step_kind) if full or not inv.tag.needs_full)
    with _LOCK:
        for tally in _OPEN:
            tally.counts[(subject, step_kind)] += n


@contextmanager
def tallying(tally: EvaluationTally | None = None) -> Iterator[EvaluationTally]:
    """Count every check's evaluations inside the block (into ``tally`` when given, to add up several blocks)."""
    opened = tally if tally is not None else EvaluationTally()
    with _LOCK:
        _OPEN.append(opened)
    try:
        yield opened
    finally:
        with _LOCK:
            _OPEN.remove(opened)
