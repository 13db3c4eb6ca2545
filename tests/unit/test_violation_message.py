"""A violation's message stays readable: long observed collections are cut, with a count of what was cut."""

from __future__ import annotations

import pickle

from contracts.violation import MAX_ITEMS, ContractViolation, render_observed


def test_a_huge_observed_list_is_cut_with_a_count_and_the_message_stays_small() -> None:
    ids = [f"req-{i}" for i in range(10_000)]
    e = ContractViolation("VER-3", "every emitted token is a real token", {"request ids": ids, "step": 7})
    message = str(e)
    assert len(message) < 2_000, len(message)
    assert "'req-0', 'req-1'" in message and f"'req-{MAX_ITEMS - 1}'" in message
    assert f"'req-{MAX_ITEMS}'" not in message
    assert f"... ({10_000 - MAX_ITEMS:,} more)" in message
    assert "step=7" in message
    assert e.observed["request ids"] == ids  # the error itself keeps every value


def test_nested_and_long_values_are_bounded() -> None:
    nested = [[list(range(100))] * 100] * 100
    message = str(
        ContractViolation("X-1", "s", {"nested": nested, "text": "a" * 100_000, "d": dict.fromkeys(range(50))})
    )
    assert len(message) < 6_000, len(message)
    assert "(84 more)" in message and "more characters)" in message and "(34 more)" in message


def test_short_values_render_exactly_as_repr() -> None:
    for value in ([1, 2, 3], (4,), (), {"a": [1]}, {3, 1, 2}, frozenset(), "text", None, 2.5, list(range(MAX_ITEMS))):
        assert render_observed(value) == repr(value), value


def test_a_cut_message_survives_pickling_with_its_full_values() -> None:
    e = ContractViolation("VER-3", "s", {"ids": list(range(5_000))})
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.observed["ids"] == list(range(5_000))
