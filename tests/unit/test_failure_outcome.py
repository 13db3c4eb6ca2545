"""A failing example names what caught it once: the report writes ``caught_by: message`` and nothing repeats it."""

from __future__ import annotations

import pytest
from jaxtyping import TypeCheckError

from contracts import ContractViolation
from specdec.testing.conformance import Outcome, failed


def test_a_violation_is_caught_by_its_id_and_its_message_leaves_the_id_out() -> None:
    error = ContractViolation("PROP-4", "non-drafting requests propose no drafts", {"num_drafts": (3, 3)})
    outcome = failed(error)
    assert outcome == Outcome(False, "PROP-4", "non-drafting requests propose no drafts\n  observed: num_drafts=(3, 3)")
    report = f"{outcome.caught_by}: {outcome.message}"  # what FamilyResult.first_failure and the matrix JSON hold
    assert report.count("PROP-4") == 1


def test_a_statement_that_mentions_its_own_id_keeps_it() -> None:
    outcome = failed(ContractViolation("IN-2", "see IN-2 in docs/contracts.md", {}))
    assert outcome.message.startswith("see IN-2 in docs/contracts.md")  # only the rendered "[IN-2] " prefix goes


@pytest.mark.parametrize(
    ("error", "caught_by", "message"),
    [
        (TypeError("draft ids must be int64"), "TypeError", "draft ids must be int64"),
        (RuntimeError(), "RuntimeError", "(no message)"),
        (
            TypeCheckError("wrong dtype of scores"),
            "TypeCheckError",
            "wrong dtype of scores",
        ),  # jaxtyping.TypeCheckError
    ],
)
def test_a_crash_is_caught_by_its_type_named_once(error: Exception, caught_by: str, message: str) -> None:
    outcome = failed(error, "fake-cuda replay: ")
    assert outcome == Outcome(False, caught_by, f"fake-cuda replay: {message}")


def test_notes_of_a_crash_stay_in_its_message() -> None:
    error = ValueError("bad block size")
    error.add_note("specdec: raised while binding the drafter")
    assert failed(error).message == "bad block size\nspecdec: raised while binding the drafter"
