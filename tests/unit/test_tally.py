"""The evaluation tally: what ``check`` evaluated, per subject and step kind, while a tally is open."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from factories import decode_facts

import contracts
from contracts import ContractViolation, StepKind, Subject, check
from contracts.registry import invariants_for
from contracts.tally import EvaluationTally, tallying

DECODE = StepKind.DRAFT_DECODE


def _expected(subject: Subject, kind: StepKind, *, full: bool) -> int:
    return sum(1 for inv in invariants_for(subject, kind) if full or not inv.tag.needs_full)


def test_each_check_counts_the_invariants_it_evaluates_in_its_mode() -> None:
    shapes, full = _expected(Subject.BATCH, DECODE, full=False), _expected(Subject.BATCH, DECODE, full=True)
    assert 0 < shapes < full  # the [D] invariants run in full only
    with tallying() as tally:
        with contracts.enforce("shapes"):
            check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")
        with contracts.enforce("full"):
            check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")
        with contracts.enforce("off"):
            check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")
    assert tally.counts == {(Subject.BATCH, DECODE): shapes + full}
    assert tally.of(Subject.BATCH) == tally.by_step_kind() == {"draft_decode": shapes + full}
    assert tally.of(Subject.PROPOSAL) == {}


def test_nothing_is_counted_outside_a_tally_and_blocks_add_up_into_a_given_one() -> None:
    n = _expected(Subject.BATCH, DECODE, full=False)
    tally = EvaluationTally()
    with tallying(tally):
        check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")
    check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")  # closed: not counted
    with tallying(tally), tallying() as inner:
        check(Subject.BATCH, decode_facts(), step_kind=DECODE, component="t")
    assert tally.by_step_kind() == {"draft_decode": 2 * n} and inner.by_step_kind() == {"draft_decode": n}


def test_a_check_that_fails_was_still_evaluated() -> None:
    broken = dataclasses.replace(decode_facts(), num_reqs=11)
    with tallying() as tally, pytest.raises(ContractViolation):
        check(Subject.BATCH, broken, step_kind=DECODE, component="t")
    assert tally.by_step_kind()["draft_decode"] > 0


def test_checks_from_rank_threads_are_all_counted() -> None:
    n = _expected(Subject.BATCH, DECODE, full=False)
    facts = decode_facts()

    def rank() -> None:
        for _ in range(50):
            check(Subject.BATCH, facts, step_kind=DECODE, component="t")

    with tallying() as tally:
        threads = [threading.Thread(target=rank) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert tally.by_step_kind() == {"draft_decode": 4 * 50 * n}
