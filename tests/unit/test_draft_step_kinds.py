"""Draft step kinds are validated where they enter: a drafter's declaration (at bind) and each ``ctx.forward``."""

from __future__ import annotations

from typing import Any

import pytest
from factories import decode_facts

from contracts import StepKind
from specdec import StepKindError
from specdec.dispatch import CaptureConfig
from specdec.draft_step_kinds import DRAFT_STEP_KINDS, declared_step_kinds, forward_step_kind
from specdec.kv_storage import PagedKVStorage
from specdec.speculator import DraftContext


def _ctx(kinds: Any) -> DraftContext:
    return DraftContext(
        backend="mine",
        step_kinds=kinds,
        capture=CaptureConfig(),
        dp_group=None,
        block_size=4,
        num_blocks=8,
        max_model_len=32,
        max_num_seqs=4,
    )


@pytest.mark.parametrize(
    "kinds",
    [
        frozenset(),
        frozenset({StepKind.DRAFT_DECODE}),
        {StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE},
        DRAFT_STEP_KINDS,
    ],
)
def test_draft_step_kinds_declared_as_enum_members_are_accepted(kinds: Any) -> None:
    assert _ctx(kinds).step_kinds == frozenset(kinds)


def test_a_string_step_kind_is_refused_with_the_member_to_write_instead() -> None:
    with pytest.raises(StepKindError) as caught:
        _ctx(frozenset({"draft_decode"}))
    message = str(caught.value)
    assert "backend 'mine'" in message and "'draft_decode' is a string" in message
    assert "write StepKind.DRAFT_DECODE, not 'draft_decode'" in message
    assert (
        "StepKind.DRAFT_BLOCK, StepKind.DRAFT_DECODE, StepKind.DRAFT_HEADS, StepKind.DRAFT_PREFILL" in message
    )  # what is allowed
    assert "checked by nothing" in message  # why it matters


@pytest.mark.parametrize(
    ("kinds", "named"),
    [
        (frozenset({StepKind.DRAFT_DECODE, "DRAFT_PREFILL"}), "write StepKind.DRAFT_PREFILL, not 'DRAFT_PREFILL'"),
        (frozenset({StepKind.TARGET}), "StepKind.TARGET is not a draft step kind"),
        (frozenset({"verify"}), "'verify' is a string, and StepKind.VERIFY is not a draft step kind"),
        (frozenset({"draft_decodes"}), "'draft_decodes' (str) is not a StepKind"),
        (frozenset({3}), "3 (int) is not a StepKind"),
    ],
)
def test_unknown_or_misspelled_kinds_are_refused_by_name(kinds: Any, named: str) -> None:
    with pytest.raises(StepKindError, match="declares draft_step_kinds") as caught:
        _ctx(kinds)
    assert named in str(caught.value)


@pytest.mark.parametrize("kinds", ["draft_decode", [StepKind.DRAFT_DECODE], None])
def test_a_declaration_that_is_not_a_set_is_refused(kinds: Any) -> None:
    with pytest.raises(StepKindError, match=r"expected a frozenset of StepKind members .*frozenset\(\{StepKind\.DRAFT"):
        declared_step_kinds("mine", kinds)


_KV = PagedKVStorage(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=2)


class _NeverRuns:
    """A draft model that must not be reached when its forward's step kind is refused."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model ran although its step kind was refused")


def test_ctx_forward_refuses_a_kind_that_is_not_a_draft_step_kind() -> None:
    ctx = _ctx(frozenset({StepKind.DRAFT_DECODE}))
    with pytest.raises(StepKindError, match="ran a forward as") as caught:
        ctx.forward(_NeverRuns(), StepKind.TARGET, decode_facts(), _KV)
    assert "StepKind.TARGET is not a draft step kind" in str(caught.value)
    with pytest.raises(StepKindError, match="ran a forward as"):
        ctx.check_batch(StepKind.VERIFY, decode_facts())


def test_a_forward_named_by_a_string_is_refused_with_the_member_to_write_instead() -> None:
    # ``ctx.forward`` is annotated ``StepKind`` (a type checker flags the string; the tests' import hook refuses it
    # before the call), so the check it runs at the call is exercised here directly, as an unchecked caller meets it.
    with pytest.raises(StepKindError, match="ran a forward as 'draft_decode'") as caught:
        forward_step_kind("mine", "draft_decode", frozenset({StepKind.DRAFT_DECODE}))
    assert "write StepKind.DRAFT_DECODE, not 'draft_decode'" in str(caught.value)
    assert forward_step_kind("mine", StepKind.DRAFT_DECODE, frozenset({StepKind.DRAFT_DECODE})) is StepKind.DRAFT_DECODE


def test_ctx_forward_refuses_a_kind_the_drafter_did_not_declare() -> None:
    ctx = _ctx(frozenset({StepKind.DRAFT_BLOCK}))
    with pytest.raises(StepKindError, match=r"ran a draft_decode forward but declared only \['draft_block'\]: add "):
        ctx.forward(_NeverRuns(), StepKind.DRAFT_DECODE, decode_facts(), _KV)


def test_a_declared_kind_runs_its_checks_and_then_the_model() -> None:
    ctx = _ctx(frozenset({StepKind.DRAFT_DECODE}))
    # No DP group here, so no DP pad: the step runs exactly one row per request (AR-4 knows dp_size 1).
    with pytest.raises(AssertionError, match="the model ran"):
        ctx.forward(_NeverRuns(), StepKind.DRAFT_DECODE, decode_facts(num_reqs=12, model_tokens=12), _KV)
