"""Speculation counters: what a request, a run, a bench record and a bench-phases round count, in one type."""

from __future__ import annotations

import pytest

from specdec.metrics import RequestMetrics, RunMetrics, SpeculationCounters


def test_record_counts_drafts_acceptances_and_positions() -> None:
    c = SpeculationCounters()
    c.record(3, 2, 3)  # 3 drafts, the first 2 accepted, 2 + the correction emitted
    c.record(1, 1, 2)
    c.record(0, 0, 1)  # a verify step without drafts still emits the target's token
    assert (c.drafted, c.accepted, c.verify_steps, c.emitted_in_verify) == (4, 3, 3, 6)
    assert c.drafted_by_position == [2, 1, 1]
    assert c.accepted_by_position == [2, 1, 0]
    assert c.acceptance_length == 2.0
    assert c.acceptance_rate_by_position == [1.0, 1.0, 0.0]


def test_nothing_recorded_gives_zero_tau_and_no_positions() -> None:
    c = SpeculationCounters()
    assert c.acceptance_length == 0.0 and c.acceptance_rate_by_position == []


def test_add_merges_counters_of_different_widths() -> None:
    short, long = SpeculationCounters(), SpeculationCounters()
    short.record(1, 1, 2)
    long.record(4, 2, 3)
    total = SpeculationCounters()
    total.add(short)
    total.add(long)
    assert total.drafted_by_position == [2, 1, 1, 1] and total.accepted_by_position == [2, 1, 0, 0]
    assert (total.drafted, total.accepted, total.verify_steps, total.emitted_in_verify) == (5, 3, 2, 5)
    assert total.acceptance_length == 2.5
    short.add(long)  # the narrower side widens
    assert short.counts() == total.counts()


def test_counts_are_the_bench_json_fields_and_detached() -> None:
    c = SpeculationCounters()
    c.record(2, 1, 2)
    counts = c.counts()
    assert list(counts) == [
        "drafted",
        "accepted",
        "verify_steps",
        "emitted_in_verify",
        "accepted_by_position",
        "drafted_by_position",
    ]
    counts["drafted_by_position"].append(9)
    snap = c.snapshot()
    c.record(2, 2, 3)
    assert c.drafted_by_position == [2, 2] and snap.drafted_by_position == [1, 1]
    assert type(snap) is SpeculationCounters


def test_run_metrics_fold_request_metrics_but_not_preemptions() -> None:
    a, b = RequestMetrics(preemptions=2), RequestMetrics()
    a.record(2, 2, 3)
    b.record(3, 0, 1)

    class Finished:
        def __init__(self, metrics: RequestMetrics) -> None:
            self.metrics = metrics

    run = RunMetrics(steps=4, tokens_emitted=6)
    for m in (a, b):
        run.add_request(Finished(m))  # type: ignore[arg-type]
    assert run.counts() == {
        "drafted": 5,
        "accepted": 2,
        "verify_steps": 2,
        "emitted_in_verify": 4,
        "accepted_by_position": [1, 1, 0],
        "drafted_by_position": [2, 2, 1],
    }
    assert run.acceptance_length == 2.0 and run.tokens_per_step == 1.5
    assert run.acceptance_rate_by_position == pytest.approx([0.5, 0.5, 0.0])
    assert not hasattr(run, "preemptions")


def test_copy_is_detached_and_restore_puts_every_field_back_in_place() -> None:
    """What the engine relies on to undo a failed step's counting: a copy later mutations cannot reach."""
    run = RunMetrics(steps=3, tokens_emitted=7, wall_s=0.5)
    run.record(3, 2, 3)
    saved = run.copy()
    assert type(saved) is RunMetrics and saved is not run
    run.record(4, 4, 5)  # widens the position lists and bumps every count
    run.steps += 1
    run.tokens_emitted += 5
    assert saved.counts()["drafted_by_position"] == [1, 1, 1] and saved.steps == 3
    holder = run  # e.g. a streaming result that kept the run's metrics object
    run.restore(saved)
    assert holder is run and run.counts() == saved.counts()
    assert (run.steps, run.tokens_emitted, run.wall_s) == (3, 7, 0.5)
    run.record(1, 1, 2)
    assert saved.counts()["accepted_by_position"] == [1, 1, 0], "restore shared a list with the saved copy"
    req = RequestMetrics(preemptions=2)
    assert req.copy().preemptions == 2 and type(req.copy()) is RequestMetrics
