"""The one-character record of each adaptive draft-length decision, and what a policy writes there."""

from __future__ import annotations

import pytest

from specdec.draft_decisions import KINDS, count_decisions, decision_symbol, describe_decisions
from specdec.draft_length import CALIBRATION, DraftLengthPolicy
from specdec.shadow_drafts import FreeDraft
from specdec.step_cost import StepCost

TRUE = StepCost(base=0.020, per_row=0.0015, per_proposal=0.004, per_draft=0.002)


@pytest.mark.parametrize(
    ("lengths", "free", "probes", "symbol"),
    [
        ({"a": 0, "b": 0}, (), (), "."),
        ({}, (), (), "."),
        ({"a": 1, "b": 0}, (), ("a",), "p"),
        ({"a": 1, "b": 1}, (), ("a",), "1"),  # a probe beside a chosen draft: the step proposes
        ({"a": 5, "b": 0}, ("a",), (), "L"),
        ({"a": 5, "b": 2}, ("a",), (), "2"),  # the lookup's 5 are not proposed; "b"'s 2 are
        ({"a": 1, "b": 3}, ("b",), ("a",), "1"),
        ({"a": 12}, (), (), "+"),
        ({"a": 9}, (), (), "9"),
    ],
)
def test_a_decision_is_written_as_what_it_drafts(
    lengths: dict[str, int], free: tuple[str, ...], probes: tuple[str, ...], symbol: str
) -> None:
    assert decision_symbol(lengths, free=free, probes=probes) == symbol


def test_a_trace_is_counted_by_kind_and_a_stray_character_is_refused() -> None:
    assert count_decisions("cc..p4L2b+") == {
        "proposed": 3,
        "free": 1,
        "probe": 1,
        "none": 2,
        "baseline": 1,
        "calibrating": 2,
    }
    assert count_decisions("") == dict.fromkeys(KINDS, 0)
    for stray in ("0", "x", " "):
        with pytest.raises(ValueError, match="none of the characters"):
            count_decisions("..." + stray)


def test_a_policy_writes_down_each_of_its_decisions() -> None:
    policy = DraftLengthPolicy(4, probe_every=3, probe_share=1.0)
    trace = []
    for _ in CALIBRATION:
        policy.choose(["a"], base_rows=1)
        trace.append(policy.last_decision)
    for rows, draft in [(1, 0), (5, 4), (3, 2), (2, 1), (1, 0), (5, 4)]:
        policy.cost.observe(rows, draft, TRUE.seconds(rows, draft))
    for _ in range(30):
        policy.record_verification("a", 1, 0)  # every first draft rejected
    for _ in range(6):
        policy.choose(["a"], base_rows=1)
        trace.append(policy.last_decision)
    assert "".join(trace) == "c" * len(CALIBRATION) + "..p..p"  # nothing pays; every third decision probes

    known = DraftLengthPolicy(4, cost=StepCost(base=0.02, per_row=0.0005, per_proposal=0.06, per_draft=0.0))
    for _ in range(40):
        known.acceptance_of("lookup").record("old", 4, 3)  # the lookup's drafts: most accepted
        known.acceptance_of("model").record("old", 4, 4)  # the model's: all, and still not worth a proposal alone
    draft = FreeDraft(10, (1, 2, 3, 4))
    known.choose(["a", "b"], base_rows=2, sources={"a": "lookup", "b": "model"}, free_drafts={"a": draft})
    assert known.last_decision == "L"
    cheap = DraftLengthPolicy(4, cost=TRUE)
    for _ in range(40):
        cheap.record_verification("a", 4, 4)
    assert cheap.choose(["a"], base_rows=1) == {"a": 4} and cheap.last_decision == "4"


def test_a_baseline_is_written_as_such() -> None:
    """A close call with a measuring policy: the two decisions that re-measure plain decoding read ``b``."""
    cost = StepCost(base=0.02, per_row=0.002, per_proposal=0.002, per_draft=0.0)
    policy = DraftLengthPolicy(1, probe_every=10_000)
    for i in range(400):
        policy.acceptance.record("a", 1, 1 if i % 4 == 0 else 0)
    trace, last = [], 0
    for _ in range(200):
        length = policy.choose(["a"], base_rows=1)["a"]
        policy.cost.observe(1 + last, length, cost.seconds(1 + last, length))
        trace.append(policy.last_decision)
        last = length
    measured = "".join(trace[len(CALIBRATION) :])
    assert "bb" in measured and set(measured) == {"1", "b"}


def test_a_summary_names_the_kinds_made_in_report_order() -> None:
    assert describe_decisions("cc..p2L+b") == "2 proposed, 1 free, 1 probe, 2 none, 1 baseline, 2 calibrating"
    assert describe_decisions("") == "none made"
