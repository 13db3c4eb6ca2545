"""The contracts accept the conventions of a correct engine other than specdec's (vLLM's model runner v2).

Each test builds the exact descriptor and metadata values a correct step of that
convention produces and checks them in ``full`` mode; next to it, the buggy
variant of the same step must fail with the invariant that names the bug. The
conventions themselves are described in docs/conventions.md.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import block_facts, decode_metadata

import contracts
from contracts import (
    PAD_SLOT_ID,
    BatchExecutionDescriptor,
    BatchFacts,
    ContractViolation,
    CUDAGraphMode,
    DescriptorFacts,
    DPFacts,
    DPSyncState,
    StepKind,
    Subject,
    check,
)

NONE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL
DECODE, PREFILL, BLOCK = StepKind.DRAFT_DECODE, StepKind.DRAFT_PREFILL, StepKind.DRAFT_BLOCK
K = 3
"""Drafts per request: a verify step has K + 1 tokens per request."""


def passes(subject: Subject, facts: object, kind: StepKind) -> None:
    with contracts.enforce("full"):
        check(subject, facts, step_kind=kind, component="test")


def fails(invariant_id: str, subject: Subject, facts: object, kind: StepKind) -> ContractViolation:
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        check(subject, facts, step_kind=kind, component="test")
    assert info.value.invariant_id == invariant_id, str(info.value)
    return info.value


def draft_decode(
    desc: BatchExecutionDescriptor, num_reqs: int, *, dp_size: int | None, attention_rows: int | None = None
) -> BatchFacts:
    """A draft decode step as vLLM builds it: attention on one query per request, model rows ``desc.num_tokens``.

    ``attention_rows`` defaults to the fixed releases' rule (``desc.num_tokens``
    under FULL, the real queries otherwise); the slot mapping is the per-layer
    one handed to the forward, so it covers the model rows with PAD past the
    real requests.
    """
    rows = desc.num_reqs_padded(num_reqs)
    if attention_rows is None:
        attention_rows = desc.num_tokens if desc.cg_mode is FULL else num_reqs
    meta = decode_metadata(num_reqs, rows, attention_rows, model_tokens=desc.num_tokens)
    base = torch.arange(num_reqs, dtype=torch.int64) + 5
    positions = torch.zeros(desc.num_tokens, dtype=torch.int64)
    positions[:num_reqs] = base + 1
    seq = meta.seq_lens.clone()
    seq[:num_reqs] = (positions[:num_reqs] + 1).to(seq.dtype)
    meta = dataclasses.replace(meta, seq_lens=seq, seq_lens_cpu=None)  # vLLM keeps only an upper bound on the host
    return BatchFacts(
        desc=desc,
        num_reqs=num_reqs,
        num_tokens=num_reqs,
        meta=meta,
        input_ids=torch.zeros(desc.num_tokens, dtype=torch.int64),
        positions=positions,
        hidden_states=torch.zeros((desc.num_tokens, 8)),
        base_positions=base,
        draft_step=1,
        max_model_len=4096,
        dp_size=dp_size,
    )


# -- AR: draft decode -------------------------------------------------------------------------------------------------

CORRECT_DECODE = {
    # DP=1, no graph: vLLM's eager dispatch returns no uniform count.
    "eager DP=1": (BatchExecutionDescriptor(cg_mode=NONE, num_tokens=12, num_reqs=12), 12, 1),
    # DP=2, 12 requests here and 13 on the peer: model rows padded to the peer's count, attention on 12.
    "eager DP=2 uneven": (BatchExecutionDescriptor(cg_mode=NONE, num_tokens=13, num_reqs=12), 12, 2),
    # A FULL graph of 16 one-query requests for 12 real ones.
    "FULL with request padding": (
        BatchExecutionDescriptor(cg_mode=FULL, num_tokens=16, num_reqs=16, uniform_token_count=1),
        12,
        1,
    ),
    # Graph mode on, but the DP maximum (13) has no graph: NONE after the sync, DP pad kept in the model rows.
    "NONE after the DP sync, fixed release": (
        BatchExecutionDescriptor(cg_mode=NONE, num_tokens=13, num_reqs=12),
        12,
        2,
    ),
    # specdec's own eager DP sync: the draft decode descriptor may carry no uniform count, DP size not passed.
    "specdec eager DP, uniform None": (BatchExecutionDescriptor(cg_mode=NONE, num_tokens=3, num_reqs=2), 2, None),
    # An idle specdec rank's one-token dummy decode row, no requests.
    "specdec idle rank dummy row": (BatchExecutionDescriptor(cg_mode=NONE, num_tokens=1, num_reqs=0), 0, 4),
}


@pytest.mark.parametrize("case", sorted(CORRECT_DECODE))
def test_correct_draft_decode_conventions_pass(case: str) -> None:
    desc, num_reqs, dp_size = CORRECT_DECODE[case]
    passes(Subject.BATCH, draft_decode(desc, num_reqs, dp_size=dp_size), DECODE)


@pytest.mark.parametrize(
    ("case", "desc", "dp_size"),
    [
        # The verify step's eager descriptor (K + 1 tokens per request, no uniform count) reused without DP.
        ("eager verify-shaped, DP=1", BatchExecutionDescriptor(cg_mode=NONE, num_tokens=12 * (K + 1), num_reqs=12), 1),
        # The verify step's uniform count kept: wrong whatever the DP size.
        (
            "eager verify-shaped with its uniform count",
            BatchExecutionDescriptor(cg_mode=NONE, num_tokens=12 * (K + 1), num_reqs=12, uniform_token_count=K + 1),
            None,
        ),
        # The verify step's FULL graph: 4 requests of K + 1 tokens, not 16 one-query requests.
        (
            "FULL verify-shaped",
            BatchExecutionDescriptor(cg_mode=FULL, num_tokens=16, num_reqs=4, uniform_token_count=K + 1),
            1,
        ),
    ],
)
def test_verify_shaped_draft_decode_is_ar_4(case: str, desc: BatchExecutionDescriptor, dp_size: int | None) -> None:
    facts = draft_decode(desc, 12 if desc.cg_mode is NONE else 4, dp_size=dp_size)
    err = fails("AR-4", Subject.BATCH, facts, DECODE)
    assert "K+1" in str(err), case


def test_dp_pad_in_draft_attention_is_ar_5_on_the_pre_fix_releases() -> None:
    """12 requests in a NONE descriptor of 13 rows after the DP sync; the attention count taken from the descriptor."""
    desc = BatchExecutionDescriptor(cg_mode=NONE, num_tokens=13, num_reqs=12)
    passes(Subject.BATCH, draft_decode(desc, 12, dp_size=2), DECODE)
    err = fails("AR-5", Subject.BATCH, draft_decode(desc, 12, dp_size=2, attention_rows=13), DECODE)
    assert "DP padding leaked" in str(err)


def test_attention_slot_mapping_instead_of_the_per_layer_one_is_ar_6() -> None:
    """Fixed releases size the attention slot mapping by the attention rows; the forward's covers the model rows."""
    facts = draft_decode(BatchExecutionDescriptor(cg_mode=NONE, num_tokens=13, num_reqs=12), 12, dp_size=2)
    attention_only = dataclasses.replace(facts.meta, slot_mapping=facts.meta.slot_mapping[:12])
    fails("AR-6", Subject.BATCH, dataclasses.replace(facts, meta=attention_only), DECODE)


def test_eager_rows_below_the_requests_are_ar_4() -> None:
    facts = draft_decode(BatchExecutionDescriptor(cg_mode=NONE, num_tokens=13, num_reqs=12), 12, dp_size=2)
    short = dataclasses.replace(facts, desc=BatchExecutionDescriptor(cg_mode=NONE, num_tokens=11, num_reqs=12))
    fails("AR-4", Subject.BATCH, short, DECODE)


# -- AR-1: draft prefill ----------------------------------------------------------------------------------------------


def draft_prefill(target_tokens: int, draft_tokens: int, input_rows: int) -> BatchFacts:
    target = BatchExecutionDescriptor(
        cg_mode=FULL, num_tokens=target_tokens, num_reqs=target_tokens // (K + 1), uniform_token_count=K + 1
    )
    desc = BatchExecutionDescriptor(
        cg_mode=FULL, num_tokens=draft_tokens, num_reqs=draft_tokens // (K + 1), uniform_token_count=K + 1
    )
    facts = draft_decode(desc, 3, dp_size=1)
    rows = desc.num_reqs_padded(3)
    return dataclasses.replace(
        facts,
        num_tokens=3 * (K + 1),
        meta=dataclasses.replace(facts.meta, slot_mapping=torch.full((draft_tokens,), PAD_SLOT_ID)),
        input_ids=torch.zeros(input_rows, dtype=torch.int64),
        positions=torch.zeros(input_rows, dtype=torch.int64),
        hidden_states=torch.zeros((input_rows, 8)),
        target_desc=target,
        last_token_indices=torch.tensor([3, 7, 11] + [0] * (rows - 3)),
        base_positions=None,
        draft_step=None,
    )


def test_draft_prefill_graph_padding_further_than_the_target_passes_ar_1() -> None:
    """The drafter's prefill graph (its own capture sizes) pads 16 target rows to 24; every target row is covered."""
    from contracts.invariants.autoregressive import ar_1
    from contracts.registry import ValueReader

    assert ar_1(draft_prefill(16, 24, 24), ValueReader(allow_device=True)) is None
    assert ar_1(draft_prefill(16, 16, 16), ValueReader(allow_device=True)) is None


@pytest.mark.parametrize(("target", "draft", "inputs"), [(16, 12, 12), (16, 24, 16), (16, 16, 12)])
def test_draft_prefill_that_drops_target_rows_or_mismatches_its_inputs_is_ar_1(
    target: int, draft: int, inputs: int
) -> None:
    from contracts.invariants.autoregressive import ar_1
    from contracts.registry import ValueReader

    assert ar_1(draft_prefill(target, draft, inputs), ValueReader(allow_device=True)) is not None


# -- BLK: block drafters ----------------------------------------------------------------------------------------------


def block_step(desc: BatchExecutionDescriptor, num_reqs: int = 12, q: int = 4, *, dp_size: int | None) -> BatchFacts:
    facts = block_facts(num_reqs, q, desc.num_tokens)
    return dataclasses.replace(facts, desc=desc, dp_size=dp_size)


@pytest.mark.parametrize(
    ("case", "desc", "dp_size"),
    [
        ("eager DP=1, no uniform count", BatchExecutionDescriptor(cg_mode=NONE, num_tokens=48, num_reqs=12), 1),
        (
            "eager DP=2 uneven, padded to the peer's 13 requests",
            BatchExecutionDescriptor(cg_mode=NONE, num_tokens=52, num_reqs=12),
            2,
        ),
        ("eager, DP size not given", BatchExecutionDescriptor(cg_mode=NONE, num_tokens=52, num_reqs=12), None),
    ],
)
def test_correct_eager_block_step_passes(case: str, desc: BatchExecutionDescriptor, dp_size: int | None) -> None:
    passes(Subject.BATCH, block_step(desc, dp_size=dp_size), BLOCK)


@pytest.mark.parametrize(
    ("case", "desc", "dp_size"),
    [
        (
            "one-query shaped",
            BatchExecutionDescriptor(cg_mode=NONE, num_tokens=48, num_reqs=12, uniform_token_count=1),
            2,
        ),
        (
            "model rows past the queries without DP",
            BatchExecutionDescriptor(cg_mode=NONE, num_tokens=52, num_reqs=12),
            1,
        ),
        ("model rows below the queries", BatchExecutionDescriptor(cg_mode=NONE, num_tokens=44, num_reqs=12), 2),
    ],
)
def test_mis_shaped_block_step_is_blk_2(case: str, desc: BatchExecutionDescriptor, dp_size: int | None) -> None:
    facts = dataclasses.replace(block_step(_none(max(desc.num_tokens, 48), 12), dp_size=dp_size), desc=desc)
    fails("BLK-2", Subject.BATCH, facts, BLOCK)


def test_dp_pad_in_block_attention_is_blk_3() -> None:
    facts = block_step(BatchExecutionDescriptor(cg_mode=NONE, num_tokens=52, num_reqs=12), dp_size=2)
    bad = dataclasses.replace(facts, meta=dataclasses.replace(facts.meta, num_tokens_padded=52))
    fails("BLK-3", Subject.BATCH, bad, BLOCK)


BS = 16


def cached_block_rows(num_reqs: int = 12, q: int = 4, model_tokens: int = 52) -> BatchFacts:
    """vLLM's block step writes each real block row's K/V at its own position in its own blocks; padded rows PAD."""
    facts = block_step(
        BatchExecutionDescriptor(cg_mode=NONE, num_tokens=model_tokens, num_reqs=num_reqs), num_reqs, q, dp_size=2
    )
    table = torch.arange(num_reqs * 4, dtype=torch.int32).reshape(num_reqs, 4) + 1
    slots = torch.full((model_tokens,), PAD_SLOT_ID, dtype=torch.int64)
    for row in range(num_reqs * q):
        p = int(facts.positions[row])
        slots[row] = int(table[row // q, p // BS]) * BS + p % BS
    meta = dataclasses.replace(facts.meta, block_table=table, slot_mapping=slots)
    return dataclasses.replace(facts, meta=meta, block_size=BS)


def test_block_rows_cached_at_their_own_positions_pass_blk_6() -> None:
    passes(Subject.BATCH, cached_block_rows(), BLOCK)


@pytest.mark.parametrize(
    ("case", "row", "slot"),
    [
        ("a block row writes the next request's slot", 3, lambda f: int(f.meta.slot_mapping[4])),
        ("a padded row writes a live slot", 49, lambda f: int(f.meta.slot_mapping[0]) + 1),
        ("a block row writes one position behind its own", 0, lambda f: int(f.meta.slot_mapping[0]) - 1),
    ],
)
def test_block_rows_writing_elsewhere_are_blk_6(case: str, row: int, slot: object) -> None:
    facts = cached_block_rows()
    slots = facts.meta.slot_mapping.clone()
    slots[row] = slot(facts)  # type: ignore[operator]
    fails(
        "BLK-6",
        Subject.BATCH,
        dataclasses.replace(facts, meta=dataclasses.replace(facts.meta, slot_mapping=slots)),
        BLOCK,
    )


def test_cached_block_rows_without_a_block_size_are_blk_6() -> None:
    """Without block_size no slot can be told to be the row's own: only PAD_SLOT_ID is accepted."""
    fails("BLK-6", Subject.BATCH, dataclasses.replace(cached_block_rows(), block_size=None), BLOCK)


# -- DP sync and descriptor -------------------------------------------------------------------------------------------


def _none(num_tokens: int, num_reqs: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=NONE, num_tokens=num_tokens, num_reqs=num_reqs)


@pytest.mark.parametrize(
    ("case", "facts"),
    [
        # The target step's eager sync: each rank keeps its own count.
        (
            "eager, own counts",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(12, 13)), _none(12, 12), 0, 12),
        ),
        # The draft decode reusing the target's sync: every rank padded to the largest request count.
        (
            "eager draft decode padded alike",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(13, 13)), _none(13, 12), 0, 12),
        ),
        # An idle rank's one-token dummy step.
        (
            "idle rank dummy step",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(1, 13)), _none(1, 1), 0, 1),
        ),
        # No collective counter and no view of the peers: DP-3 has nothing to compare and passes.
        (
            "no cross-rank evidence",
            DPFacts(
                DPSyncState(dp_size=4, cg_mode=FULL, num_tokens_across_dp=(16,) * 4),
                BatchExecutionDescriptor(cg_mode=FULL, num_tokens=16, num_reqs=16, uniform_token_count=1),
                3,
                12,
            ),
        ),
    ],
)
def test_correct_dp_sync_conventions_pass(case: str, facts: DPFacts) -> None:
    passes(Subject.DP, facts, StepKind.DP_SYNC)


@pytest.mark.parametrize(
    ("case", "facts"),
    [
        # The peers were told 13 but this rank runs its own 12.
        (
            "runs other than its entry",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(13, 13)), _none(12, 12), 0, 12),
        ),
        # One eager rank alone keeps a pad: its entry exceeds its count while the other rank's does not.
        (
            "padded alone",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(16, 13)), _none(16, 12), 0, 12),
        ),
        # Fewer rows than tokens.
        (
            "entry below the tokens",
            DPFacts(DPSyncState(dp_size=2, cg_mode=NONE, num_tokens_across_dp=(11, 11)), _none(11, 11), 0, 12),
        ),
    ],
)
def test_broken_eager_dp_sync_is_dp_2(case: str, facts: DPFacts) -> None:
    fails("DP-2", Subject.DP, facts, StepKind.DP_SYNC)


def test_idle_dummy_step_passes_desc_5_and_a_skipped_one_fails() -> None:
    """An idle vLLM rank runs one dummy request of one token while its peers are busy; all idle, nobody runs."""
    passes(Subject.DESCRIPTOR, DescriptorFacts(_none(1, 1), 1, 1, all_ranks_idle=False), StepKind.DP_SYNC)
    passes(Subject.DESCRIPTOR, DescriptorFacts(_none(0, 0), 0, 0, all_ranks_idle=True), StepKind.DP_SYNC)
    fails("DESC-5", Subject.DESCRIPTOR, DescriptorFacts(_none(0, 0), 0, 0, all_ranks_idle=False), StepKind.DP_SYNC)


# -- TGT-7: max_query_len as an upper bound ---------------------------------------------------------------------------


def target_step(max_query_len: int) -> BatchFacts:
    """Three requests of 4, 4 and 1 tokens, eager; ``max_query_len`` as the metadata builder reported it."""
    qsl = torch.tensor([0, 4, 8, 9], dtype=torch.int32)
    seq = torch.tensor([20, 30, 9], dtype=torch.int32)
    meta = decode_metadata(3, 3, 9, model_tokens=9)
    meta = dataclasses.replace(
        meta,
        num_tokens=9,
        max_query_len=max_query_len,
        seq_lens=seq,
        seq_lens_cpu=None,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        slot_mapping=torch.arange(9, dtype=torch.int64) + 100,
    )
    return BatchFacts(
        desc=_none(9, 3),
        num_reqs=3,
        num_tokens=9,
        meta=meta,
        input_ids=torch.zeros(9, dtype=torch.int64),
        positions=torch.zeros(9, dtype=torch.int64),
    )


def test_target_max_query_len_upper_bound_passes_and_too_small_is_tgt_7() -> None:
    """vLLM's adaptive verification reports the scheduled bound (5 here) over a longest query of 4."""
    passes(Subject.BATCH, target_step(4), StepKind.TARGET)
    passes(Subject.BATCH, target_step(5), StepKind.TARGET)
    fails("TGT-7", Subject.BATCH, target_step(1), StepKind.TARGET)
