"""AR-* and BLK-*: well-formed draft steps pass; each invariant is triggered on purpose."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from factories import block_facts, decode_facts

import contracts
from contracts import (
    BatchExecutionDescriptor,
    BatchFacts,
    CapacityEvidence,
    ConfidenceEvidence,
    ContractViolation,
    CUDAGraphMode,
    MarkovChainEvidence,
    ProposalFacts,
    StepKind,
    Subject,
    check,
)

DECODE, PREFILL, BLOCK = StepKind.DRAFT_DECODE, StepKind.DRAFT_PREFILL, StepKind.DRAFT_BLOCK


def expect(
    invariant_id: str, subject: Subject, facts: object, kind: StepKind, backend: str | None = None
) -> ContractViolation:
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        check(subject, facts, step_kind=kind, component="test", backend=backend)
    assert info.value.invariant_id == invariant_id, str(info.value)
    return info.value


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL])
def test_correct_decode_step_passes_in_full_mode(mode: CUDAGraphMode) -> None:
    with contracts.enforce("full"):
        check(Subject.BATCH, decode_facts(mode=mode), step_kind=DECODE, component="test")


def test_correct_block_step_passes_in_full_mode() -> None:
    with contracts.enforce("full"):
        check(Subject.BATCH, block_facts(), step_kind=BLOCK, component="test")
        check(Subject.BATCH, block_facts(model_tokens=52), step_kind=BLOCK, component="test")


def test_motivating_bug_is_ar_5_and_names_dp_padding() -> None:
    """12 requests, 13 DP-padded model rows, metadata built for 13 queries (pre-fix vLLM)."""
    facts = decode_facts()
    bad = dataclasses.replace(facts, meta=dataclasses.replace(facts.meta, num_tokens_padded=13))
    err = expect("AR-5", Subject.BATCH, bad, DECODE)
    assert "DP padding leaked into draft attention metadata" in str(err)
    with contracts.enforce("shapes"), pytest.raises(ContractViolation, match=r"\[AR-5\]"):
        check(Subject.BATCH, bad, step_kind=DECODE, component="test")


def _replace_meta(facts: BatchFacts, **kw: object) -> BatchFacts:
    return dataclasses.replace(facts, meta=dataclasses.replace(facts.meta, **kw))  # type: ignore[arg-type]


def _prefill() -> BatchFacts:
    facts = decode_facts()
    target = facts.desc
    return dataclasses.replace(
        facts, target_desc=target, last_token_indices=torch.tensor(list(range(12)), dtype=torch.int64)
    )


def _ar_2() -> BatchFacts:
    f = _prefill()
    idx = f.last_token_indices.clone()  # type: ignore[union-attr]
    idx[3] = 4  # request 3's last token taken from request 4's range
    return dataclasses.replace(f, last_token_indices=idx)


def _cut_model_rows(facts: BatchFacts, rows: int) -> BatchFacts:
    """Model inputs cut to the request count: DP collectives would no longer line up."""
    hidden = facts.hidden_states[:rows] if facts.hidden_states is not None else None
    return dataclasses.replace(
        facts, input_ids=facts.input_ids[:rows], positions=facts.positions[:rows], hidden_states=hidden
    )


def _ar_8() -> BatchFacts:
    f = decode_facts()
    pos = f.positions.clone()
    pos[:12] -= 1  # positions not advanced for this step
    return dataclasses.replace(f, positions=pos)


TRIGGERS: dict[str, tuple[Subject, StepKind, Callable[[], object], str | None]] = {
    "AR-1": (Subject.BATCH, PREFILL, lambda: _cut_model_rows(_prefill(), 12), None),
    "AR-2": (Subject.BATCH, PREFILL, _ar_2, None),
    "AR-3": (
        Subject.BATCH,
        DECODE,
        lambda: dataclasses.replace(
            decode_facts(), desc=BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=13)
        ),
        None,
    ),
    "AR-4": (
        Subject.BATCH,
        DECODE,
        lambda: dataclasses.replace(
            decode_facts(mode=CUDAGraphMode.FULL, model_tokens=16),
            desc=BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=16, num_reqs=8, uniform_token_count=2),
        ),
        None,
    ),
    "AR-5": (Subject.BATCH, DECODE, lambda: _replace_meta(decode_facts(), num_tokens_padded=13), None),
    "AR-6": (Subject.BATCH, DECODE, lambda: _cut_model_rows(decode_facts(), 12), None),
    "AR-7": (Subject.BATCH, DECODE, lambda: _replace_meta(decode_facts(), max_query_len=2), None),
    "AR-8": (Subject.BATCH, DECODE, _ar_8, None),
    "AR-9": (
        Subject.PROPOSAL,
        DECODE,
        lambda: ProposalFacts(decode_facts().desc, 12, 3, torch.zeros((12, 2), dtype=torch.int64)),
        None,
    ),
    "BLK-1": (Subject.BATCH, BLOCK, lambda: block_facts(q=4, n_spec=4), None),
    "BLK-2": (
        Subject.BATCH,
        BLOCK,
        lambda: dataclasses.replace(
            block_facts(),
            desc=BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE, num_tokens=48, num_reqs=12, uniform_token_count=3
            ),
        ),
        None,
    ),
    "BLK-3": (Subject.BATCH, BLOCK, lambda: _replace_meta(block_facts(model_tokens=52), num_tokens_padded=52), None),
    "BLK-4": (
        Subject.BATCH,
        BLOCK,
        lambda: _replace_meta(
            block_facts(), query_start_loc_cpu=torch.tensor([0, 4, 8] + [12] * 10, dtype=torch.int32)
        ),
        None,
    ),
    "BLK-5": (
        Subject.BATCH,
        BLOCK,
        lambda: dataclasses.replace(block_facts(), base_positions=torch.arange(12) + 11),
        None,
    ),
    "BLK-6": (
        Subject.BATCH,
        BLOCK,
        lambda: dataclasses.replace(block_facts(), context_slot_mapping=torch.tensor([3, 4, 5, -1])),
        None,
    ),
    "BLK-7": (
        Subject.PROPOSAL,
        BLOCK,
        lambda: ProposalFacts(
            block_facts().desc, 12, 3, torch.zeros((12, 3), dtype=torch.int64), sample_indices=torch.arange(39)
        ),
        None,
    ),
    "BLK-8": (
        Subject.PROPOSAL,
        BLOCK,
        lambda: ProposalFacts(
            block_facts().desc,
            2,
            3,
            torch.zeros((2, 3), dtype=torch.int64),
            capacity=CapacityEvidence(
                capacity=torch.tensor([2, 3]), prefix_mask=torch.tensor([[True, False, True], [True, True, True]])
            ),
        ),
        "acme-block",
    ),
}


@pytest.mark.parametrize("invariant_id", sorted(TRIGGERS))
def test_each_draft_invariant_triggers(invariant_id: str) -> None:
    subject, kind, build, backend = TRIGGERS[invariant_id]
    expect(invariant_id, subject, build(), kind, backend)


def test_blk_3_regression_names_dp_padding() -> None:
    err = expect("BLK-3", Subject.BATCH, _replace_meta(block_facts(model_tokens=52), num_tokens_padded=52), BLOCK)
    assert "DP padding leaked" in str(err)


def _evidence_facts(**parts: object) -> ProposalFacts:
    return ProposalFacts(block_facts().desc, 2, 3, torch.zeros((2, 3), dtype=torch.int64), **parts)  # type: ignore[arg-type]


GOOD_EVIDENCE: dict[str, object] = {
    "markov": MarkovChainEvidence(
        anchor_token_ids=torch.tensor([5, 6]), prev_token_ids=torch.tensor([[5, 1, 1], [6, 2, 2]])
    ),
    "capacity": CapacityEvidence(
        capacity=torch.tensor([2, 0]), prefix_mask=torch.tensor([[True, True, False], [False, False, False]])
    ),
    "confidence": ConfidenceEvidence(survival=torch.tensor([[0.9, 0.5, 0.5], [0.9, 0.8, 0.1]])),
}


@pytest.mark.parametrize("backend", ["dspark", "acme-block", None])
def test_blk_8_is_silent_on_correct_evidence_whatever_the_backend(backend: str | None) -> None:
    with contracts.enforce("full"):
        check(Subject.PROPOSAL, _evidence_facts(**GOOD_EVIDENCE), step_kind=BLOCK, component="test", backend=backend)
        check(Subject.PROPOSAL, _evidence_facts(), step_kind=BLOCK, component="test", backend=backend)


@pytest.mark.parametrize(
    ("name", "part", "bad"),
    [
        (
            "markov chain starts elsewhere",
            "markov",
            MarkovChainEvidence(
                anchor_token_ids=torch.tensor([5, 6]), prev_token_ids=torch.tensor([[5, 1, 1], [7, 1, 1]])
            ),
        ),
        (
            "capacity out of range",
            "capacity",
            CapacityEvidence(capacity=torch.tensor([4, 0]), prefix_mask=torch.zeros((2, 3), dtype=torch.bool)),
        ),
        (
            "mask does not match capacity",
            "capacity",
            CapacityEvidence(
                capacity=torch.tensor([1, 0]), prefix_mask=torch.tensor([[True, True, False], [False, False, False]])
            ),
        ),
        (
            "survival increases",
            "confidence",
            ConfidenceEvidence(survival=torch.tensor([[0.9, 0.5, 0.6], [0.9, 0.8, 0.7]])),
        ),
    ],
)
@pytest.mark.parametrize("backend", ["dspark", "acme-block"])
def test_blk_8_catches_every_bug_pattern_by_capability_not_backend(
    name: str, part: str, bad: object, backend: str
) -> None:
    """Each broken part is caught on its own and next to correct other parts, whatever the drafter is called."""
    expect("BLK-8", Subject.PROPOSAL, _evidence_facts(**{part: bad}), BLOCK, backend)
    expect("BLK-8", Subject.PROPOSAL, _evidence_facts(**{**GOOD_EVIDENCE, part: bad}), BLOCK, backend)


def test_blk_8_reads_values_only_in_full_mode() -> None:
    """BLK-8 is [D]: in ``shapes`` a broken chain costs no device read and raises nothing."""
    bad = MarkovChainEvidence(
        anchor_token_ids=torch.tensor([5, 6]), prev_token_ids=torch.tensor([[0, 1, 1], [0, 1, 1]])
    )
    with contracts.enforce("shapes"):
        check(Subject.PROPOSAL, _evidence_facts(markov=bad), step_kind=BLOCK, component="test", backend="acme-block")


def test_ar_6_catches_a_slot_mapping_sized_by_requests() -> None:
    facts = decode_facts()
    short = dataclasses.replace(facts.meta, slot_mapping=torch.full((12,), -1, dtype=torch.int64))
    expect("AR-6", Subject.BATCH, dataclasses.replace(facts, meta=short), DECODE)
