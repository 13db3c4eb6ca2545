"""No vacuous conformance pass: step kinds are validated at bind, and a family whose draft forwards went unchecked fails.

The planted bug is the motivating one: padded rows of EAGLE's draft decode write
a live KV slot (``eagle-padded-decode-row-writes-live-slot``). It keeps the
output lossless, so only the draft-forward contracts can see it. EAGLE itself
fails KV-3 on it; the drafters of ``step_kind_drafters`` wrap the same EAGLE
but reach the contracts wrongly, and each must fail with a message naming its
fault, where before they passed.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import step_kind_drafters
from step_kind_drafters import string_step_kinds, unchecked_forwards, undeclared_unchecked_forwards

from specdec import Engine, StepKindError
from specdec.backend_registry import factory_for
from specdec.nn.transformer import Transformer
from specdec.testing import corpus
from specdec.testing.conformance import MODEL, FamilyResult, run_family
from specdec.testing.forward_coverage import UNCHECKED_FORWARDS, ForwardCoverage

PLANTED = "eagle-padded-decode-row-writes-live-slot"


@pytest.fixture
def planted() -> Iterator[None]:
    with corpus.injected((PLANTED,)):
        yield


def _dp(factory: object, examples: int = 4, tensor_mode: str = "cpu") -> FamilyResult:
    return run_family(factory, "dp", examples=examples, tensor_mode=tensor_mode)  # type: ignore[arg-type]


def test_eagle_catches_the_planted_bug_and_its_forwards_are_counted(planted: None) -> None:
    result = _dp(factory_for("eagle"))
    assert "KV-3" in result.caught_by
    assert result.draft_forward_evaluations["draft_decode"] > 0


def test_a_drafter_declaring_string_step_kinds_is_refused_at_bind() -> None:
    target = Transformer(MODEL, seed=0)
    with pytest.raises(StepKindError, match=r"write StepKind\.DRAFT_DECODE, not 'draft_decode'"):
        Engine(target, speculator=string_step_kinds(target, num_spec_tokens=2))


@pytest.mark.parametrize("tensor_mode", ["cpu", "fake-cuda"])
def test_the_string_step_kind_drafter_fails_conformance_naming_the_fix(planted: None, tensor_mode: str) -> None:
    result = _dp(string_step_kinds, tensor_mode=tensor_mode)
    assert not result.passed and set(result.caught_by) == {"StepKindError"}
    assert result.first_failure_example == 1
    assert "write StepKind.DRAFT_DECODE, not 'draft_decode'" in (result.first_failure or "")


@pytest.mark.parametrize("factory", [unchecked_forwards, undeclared_unchecked_forwards], ids=["declared", "undeclared"])
@pytest.mark.parametrize("tensor_mode", ["cpu", "fake-cuda"])
def test_forwards_that_bypass_the_check_fail_the_family(planted: None, factory: object, tensor_mode: str) -> None:
    result = _dp(factory, tensor_mode=tensor_mode)
    assert result.caught_by == [UNCHECKED_FORWARDS], result.first_failure
    assert result.first_failure_example is None and result.drafted > 0
    message = result.first_failure or ""
    assert "no contract checked your draft forwards" in message
    assert "allocated draft KV caches ['autoregressive']" in message
    assert "Run every draft forward through ctx.forward(model, StepKind.DRAFT_..." in message
    if factory is unchecked_forwards:
        assert "declares draft step kinds ['draft_decode', 'draft_prefill']" in message
    assert result.evaluations["target"] > 0 and result.draft_forward_evaluations == {}


def test_the_bypass_passed_before_the_guard(planted: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding itself: without the guard the planted bug passes, because no draft forward was checked."""
    monkeypatch.setattr(ForwardCoverage, "unchecked", lambda self: None)
    result = _dp(unchecked_forwards)
    assert result.passed and result.drafted > 0 and result.draft_forward_evaluations == {}


@pytest.mark.parametrize("backend", ["eagle", "draft-model", "dflash", "dspark", "ngram"])
def test_correct_backends_pass_with_their_forwards_counted(backend: str) -> None:
    result = _dp(factory_for(backend), examples=2)
    assert result.passed, result.first_failure
    assert result.drafted > 0 and result.evaluations["target"] > 0
    if backend == "ngram":  # no forwards: nothing to count, nothing demanded
        assert result.declared_step_kinds == [] and result.draft_forward_evaluations == {}
    else:
        assert sum(result.draft_forward_evaluations.values()) > 0
        assert set(result.draft_forward_evaluations) <= set(result.declared_step_kinds)


def test_a_family_in_which_nothing_was_drafted_is_not_blamed() -> None:
    coverage = ForwardCoverage(declared_step_kinds={"draft_decode"}, draft_caches={"autoregressive"})
    assert coverage.unchecked() is None  # no drafts verified: no claim that forwards ran
    coverage.drafted = 3
    assert "no contract checked your draft forwards" in (coverage.unchecked() or "")


def test_plugin_and_matrix_report_the_unchecked_forwards(pytester: pytest.Pytester) -> None:
    support = Path(step_kind_drafters.__file__).parent
    pytester.makepyfile(
        bypass=textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(support)!r})
            from step_kind_drafters import unchecked_forwards
            """
        )
    )
    args = ["--specdec-examples", "2", "--specdec-families", "dp", "--specdec-tensor-modes", "cpu"]
    run = pytester.runpytest_subprocess(
        "--specdec-backend", "bypass:unchecked_forwards", "-p", "no:cacheprovider", *args
    )
    run.assert_outcomes(failed=1)
    assert "failed family 'dp' (cpu) over its 2 generated examples: unchecked-forwards" in run.stdout.str()
    assert "no contract checked your draft forwards" in run.stdout.str()
