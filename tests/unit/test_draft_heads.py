"""The KV-less heads forward (``DraftContext.forward_heads``) and the public draft step shape (``sync_draft_step``).

Each check is shown silent on a correct heads step (with and without a DP pad)
and firing on the bug it exists for: the DP pad dropped from the heads' rows
(HEAD-2), another step's descriptor reused (HEAD-1), the pad counted as
requests (DESC-3), non-finite head logits (VER-8).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from jaxtyping import Float
from torch import Tensor

import contracts
from contracts import BatchExecutionDescriptor, ContractViolation, CUDAGraphMode, HeadFacts, StepKind, Subject, check
from specdec import DPGroup, DraftContext, DraftStep, StepKindError, pad_model_rows, padded_rows, sync_draft_step
from specdec.dispatch import CaptureConfig
from specdec.dp_group import in_process_world
from specdec.draft_builders import draft_decode_positions

HIDDEN, VOCAB, HEADS = 8, 11, 3


class LinearHeads:
    """``HEADS`` linear heads; ``nan`` plants a NaN weight in head 1."""

    def __init__(self, *, nan: bool = False) -> None:
        self.weight = torch.randn(HEADS, VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
        if nan:
            self.weight[1, 0, 0] = float("nan")
        self.calls: list[int] = []

    def __call__(
        self,
        hidden_states: Float[Tensor, "rows hidden"],
        *,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "rows heads vocab"]:
        self.calls.append(hidden_states.shape[0])
        return torch.einsum("rd,kvd->rkv", hidden_states, self.weight)


def context(kinds: frozenset[StepKind] = frozenset({StepKind.DRAFT_HEADS}), dp: DPGroup | None = None) -> DraftContext:
    return DraftContext(
        backend="heads",
        step_kinds=kinds,
        capture=CaptureConfig(),
        dp_group=dp,
        block_size=4,
        num_blocks=16,
        max_model_len=64,
        max_num_seqs=8,
    )


def eager(num_reqs: int, rows: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=rows, num_reqs=num_reqs, uniform_token_count=1 if num_reqs else None
    )


# -- forward_heads: silent on correct steps --------------------------------------------------------


def test_a_correct_heads_step_passes_every_check_and_runs_the_heads_once() -> None:
    heads, ctx = LinearHeads(), context()
    _, desc = ctx.sync(3, 3, 1, allow_piecewise=False, purpose="heads")
    with contracts.enforce("full"):
        logits = ctx.forward_heads(heads, desc, 3, torch.randn(3, HIDDEN))
    assert logits.shape == (3, HEADS, VOCAB) and heads.calls == [3]


@pytest.mark.parametrize("mode", ["shapes", "full"])
def test_dp_padded_rows_and_an_idle_ranks_dummy_rows_pass(mode: str) -> None:
    """Under DP the heads' rows may exceed the requests by the common pad; an idle rank runs only pad rows."""
    heads = LinearHeads(nan=False)
    world = in_process_world(2)
    with contracts.enforce(mode):
        for rank, (num_reqs, rows) in enumerate([(3, 3), (0, 3)]):
            ctx = context(dp=world[rank])
            ctx.forward_heads(heads, eager(num_reqs, rows), num_reqs, torch.randn(rows, HIDDEN))
    assert heads.calls == [3, 3]


def test_non_finite_logits_on_pad_rows_only_pass() -> None:
    """A padded row's values are garbage by design and never sampled: VER-8 reads the real rows only."""

    class PadNaN(LinearHeads):
        def __call__(self, hidden_states: Tensor, **kw: object) -> Tensor:  # type: ignore[override]
            out = super().__call__(hidden_states, dp_group=None, num_tokens_across_dp=None)
            out[2:] = float("nan")
            return out

    with contracts.enforce("full"):
        context(dp=in_process_world(2)[0]).forward_heads(PadNaN(), eager(2, 4), 2, torch.randn(4, HIDDEN))


# -- forward_heads: planted bugs -------------------------------------------------------------------


def test_hidden_rows_without_the_dp_pad_are_head_2() -> None:
    """The drafter gathered its requests' rows (2) but the step runs 4 rows on every rank."""
    ctx, heads = context(dp=in_process_world(2)[0]), LinearHeads()
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        ctx.forward_heads(heads, eager(2, 4), 2, torch.randn(2, HIDDEN))
    assert caught.value.invariant_id == "HEAD-2" and heads.calls == []


def test_an_idle_rank_with_no_dummy_rows_is_head_2() -> None:
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        context(dp=in_process_world(2)[1]).forward_heads(LinearHeads(), eager(0, 3), 0, torch.randn(0, HIDDEN))
    assert caught.value.invariant_id == "HEAD-2"


def test_a_verify_shaped_descriptor_is_head_1() -> None:
    """The target's verify descriptor (K + 1 tokens per request) reused for the heads."""
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=8, num_reqs=2, uniform_token_count=4)
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        context().forward_heads(LinearHeads(), desc, 2, torch.randn(8, HIDDEN))
    assert caught.value.invariant_id == "HEAD-1"


def test_extra_rows_without_dp_are_head_1_and_a_piecewise_step_too() -> None:
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        context().forward_heads(LinearHeads(), eager(2, 3), 2, torch.randn(3, HIDDEN))
    assert caught.value.invariant_id == "HEAD-1"
    piecewise = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=4)
    facts = HeadFacts(desc=piecewise, num_reqs=2, hidden_states=torch.randn(4, HIDDEN), dp_size=2)
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        check(Subject.BATCH, facts, step_kind=StepKind.DRAFT_HEADS, component="t")
    assert caught.value.invariant_id == "HEAD-1"


def test_the_dp_pad_counted_as_requests_is_desc_3() -> None:
    """num_reqs = desc.num_tokens: the pad rows taken for drafting requests (their drafts would be garbage)."""
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        context(dp=in_process_world(2)[0]).forward_heads(LinearHeads(), eager(2, 4), 4, torch.randn(4, HIDDEN))
    assert caught.value.invariant_id == "DESC-3"


def test_a_nan_head_weight_is_ver_8_in_full_only() -> None:
    ctx, desc, hidden = context(), eager(2, 2), torch.randn(2, HIDDEN)
    with contracts.enforce("shapes"):
        ctx.forward_heads(LinearHeads(nan=True), desc, 2, hidden)  # a value read: full only
    with contracts.enforce("full"), pytest.raises(ContractViolation) as caught:
        ctx.forward_heads(LinearHeads(nan=True), desc, 2, hidden)
    assert caught.value.invariant_id == "VER-8"


def test_heads_that_return_other_rows_are_a_clear_error() -> None:
    class Short(LinearHeads):
        def __call__(self, hidden_states: Tensor, **kw: object) -> Tensor:  # type: ignore[override]
            return super().__call__(hidden_states[:1], dp_group=None, num_tokens_across_dp=None)

    with pytest.raises(
        ValueError, match=r"returned logits of shape \(1, 3, 11\); expected \(rows=2, num_heads, vocab\)"
    ):
        context().forward_heads(Short(), eager(2, 2), 2, torch.randn(2, HIDDEN))


def test_an_undeclared_heads_forward_is_refused() -> None:
    with pytest.raises(StepKindError, match=r"add StepKind\.DRAFT_HEADS to its draft_step_kinds"):
        context(frozenset({StepKind.DRAFT_DECODE})).forward_heads(LinearHeads(), eager(1, 1), 1, torch.randn(1, HIDDEN))


# -- the public step shape -------------------------------------------------------------------------


def _sync_on_ranks(counts: list[int], q: int) -> list[DraftStep]:
    world = in_process_world(len(counts), timeout_s=10.0)
    out: list[DraftStep | None] = [None] * len(counts)

    def rank(r: int) -> None:
        out[r] = sync_draft_step(context(dp=world[r]), counts[r], q, purpose="heads")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is not None for s in out), "a rank failed in the sync"
    return [s for s in out if s is not None]


def test_sync_draft_step_pads_every_rank_to_the_largest_and_an_idle_rank_runs_dummy_rows() -> None:
    with contracts.enforce("full"):
        busy, idle = _sync_on_ranks([3, 0], 2)
    assert (busy.desc.num_tokens, busy.num_reqs, busy.idle, busy.skipped) == (6, 3, False, False)
    assert (idle.desc.num_tokens, idle.num_reqs, idle.idle, idle.skipped) == (6, 0, True, False)
    assert busy.num_tokens_across_dp == idle.num_tokens_across_dp == (6, 6)


def test_sync_draft_step_skips_alike_when_no_rank_drafts() -> None:
    with contracts.enforce("full"):
        steps = _sync_on_ranks([0, 0], 1)
    assert all(s.skipped and not s.idle for s in steps)
    alone = sync_draft_step(context(), 0, 1, purpose="heads")
    assert alone.skipped and alone.num_tokens_across_dp == (0,)


def test_sync_draft_step_without_dp_runs_exactly_the_requests() -> None:
    step = sync_draft_step(context(), 4, 1, purpose="heads")
    assert (step.desc.cg_mode, step.desc.num_tokens, step.desc.num_reqs) == (CUDAGraphMode.NONE, 4, 4)
    with pytest.raises(ValueError, match="query_width >= 1, got 2 and 0"):
        sync_draft_step(context(), 2, 0, purpose="heads")


def test_row_padding_and_decode_positions() -> None:
    assert padded_rows([5, 7], 4, torch.device("cpu")).tolist() == [5, 7, 0, 0]
    x = torch.ones(2, 3)
    assert pad_model_rows(x, 4).tolist() == [[1.0] * 3] * 2 + [[0.0] * 3] * 2
    with pytest.raises(ValueError, match="3 rows do not fit in 2 model rows"):
        pad_model_rows(torch.ones(3, 1), 2)
    assert draft_decode_positions([3, 62, 63], 1, 64) == [4, 63, 63]  # clamped to max_model_len - 1 (AR-8)
