"""One padded-request standard for every forward (PAD-*, KV-3), and values checked by their definition (BLK-8, VER-8..10).

Each check fires on a planted bug and stays silent on the correct value.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from factories import block_facts, decode_facts

import contracts
from backends.draw import proposal_source
from contracts import (
    PAD_SLOT_ID,
    BatchExecutionDescriptor,
    BatchFacts,
    ConfidenceEvidence,
    ContractViolation,
    CUDAGraphMode,
    ForwardOutputFacts,
    ProposalFacts,
    StepKind,
    Subject,
    VerifierFacts,
    VerifierInput,
    VerifierOutput,
    check,
)
from specdec.dispatch import CaptureConfig
from specdec.sampling import SamplingParams, probabilities
from specdec.speculator import DraftContext

DECODE, BLOCK = StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK


def violated(subject: Subject, facts: object, kind: StepKind, mode: str = "full") -> str | None:
    with contracts.enforce(mode):
        try:
            check(subject, facts, step_kind=kind, component="test")
        except ContractViolation as err:
            return err.invariant_id
    return None


def padded_decode() -> BatchFacts:
    """A FULL draft decode step: 12 real requests padded to 16 (4 padded requests)."""
    return decode_facts(num_reqs=12, model_tokens=16, mode=CUDAGraphMode.FULL)


def with_meta(facts: BatchFacts, **changes: object) -> BatchFacts:
    """A copy with metadata fields replaced, bypassing the jaxtyping check the test hook adds to the dataclass:
    production runs without that hook, so each contract must catch the bug on its own."""
    meta = copy.copy(facts.meta)
    for name, value in changes.items():
        object.__setattr__(meta, name, value)
    bad = copy.copy(facts)
    object.__setattr__(bad, "meta", meta)
    return bad


# -- one standard for every forward ----------------------------------------------------------------------------------


def test_correct_padded_draft_steps_pass_every_rule() -> None:
    assert violated(Subject.BATCH, padded_decode(), DECODE) is None
    assert violated(Subject.BATCH, block_facts(), BLOCK) is None


def test_a_draft_decode_padded_request_with_a_context_length_is_pad_2() -> None:
    facts = padded_decode()
    seq = facts.meta.seq_lens.clone()
    seq[12:] = 1
    # The host mirror shows it in shapes mode already, the device tensor alone only in full.
    assert (
        violated(Subject.BATCH, with_meta(facts, seq_lens=seq, seq_lens_cpu=seq.clone()), DECODE, "shapes") == "PAD-2"
    )
    assert violated(Subject.BATCH, with_meta(facts, seq_lens=seq, seq_lens_cpu=None), DECODE, "shapes") is None
    assert violated(Subject.BATCH, with_meta(facts, seq_lens=seq, seq_lens_cpu=None), DECODE) == "PAD-2"


def test_a_block_step_whose_seq_lens_do_not_cover_its_queries_is_pad_2() -> None:
    facts = block_facts()
    seq = facts.meta.seq_lens.clone()
    seq[0] = 1  # q = 4 queries with a context of 1
    bad = with_meta(facts, seq_lens=seq, seq_lens_cpu=seq.clone())
    assert violated(Subject.BATCH, bad, BLOCK) == "BLK-5"  # in full, the block's own (stronger) rule is named
    assert violated(Subject.BATCH, bad, BLOCK, "shapes") == "PAD-2"  # the host mirror shows the shared rule for free


def test_draft_block_table_without_the_padded_rows_is_pad_3() -> None:
    facts = padded_decode()
    assert violated(Subject.BATCH, with_meta(facts, block_table=facts.meta.block_table[:12].clone()), DECODE) == "PAD-3"


def test_a_block_id_a_kernel_reads_that_is_negative_is_pad_3_and_filler_is_not() -> None:
    facts = dataclasses.replace(padded_decode(), block_size=16)
    table = facts.meta.block_table.clone()
    table[12:] = -1  # padded rows: never read (seq_len 0), any filler is inert
    assert violated(Subject.BATCH, with_meta(facts, block_table=table), DECODE) is None
    table[0, 0] = -1  # request 0 reads its first block
    assert violated(Subject.BATCH, with_meta(facts, block_table=table), DECODE) == "PAD-3"


def test_a_draft_decode_padded_request_with_a_query_is_pad_1() -> None:
    facts = padded_decode()
    qsl = torch.tensor([*range(13), 13, 14, 15, 16], dtype=torch.int32)
    bad = with_meta(facts, query_start_loc=qsl, query_start_loc_cpu=None)
    # AR-7 (the decode step's own, stronger rule) reads the device tensor too; without it the shared rule fires.
    assert violated(Subject.BATCH, bad, DECODE) == "AR-7"
    from contracts.invariants.padded_requests import pad_1

    with contracts.enforce("full"):
        assert pad_1(bad, contracts.registry.ValueReader(True)) is not None
        assert pad_1(facts, contracts.registry.ValueReader(True)) is None


def test_a_padded_draft_row_writing_a_slot_is_kv_3_for_block_steps_too() -> None:
    facts = block_facts(model_tokens=52)
    slots = facts.meta.slot_mapping.clone()
    slots[48:] = 3
    assert violated(Subject.BATCH, with_meta(facts, slot_mapping=slots), BLOCK) in ("BLK-6", "KV-3")
    from contracts.invariants.kv import kv_3

    assert kv_3(with_meta(facts, slot_mapping=slots), contracts.registry.ValueReader(True)) is not None
    assert kv_3(facts, contracts.registry.ValueReader(True)) is None
    short = with_meta(facts, slot_mapping=torch.full((48,), PAD_SLOT_ID))
    assert violated(Subject.BATCH, short, BLOCK, "shapes") == "KV-3"


# -- DraftContext fills dp_size -------------------------------------------------------------------------------------


def test_draft_context_tells_the_checks_there_is_no_dp() -> None:
    """Eager draft decode rows past the requests: a DP pad could explain them, unless the engine says there is no DP."""
    facts = decode_facts(num_reqs=12, model_tokens=13)
    assert facts.dp_size is None
    assert violated(Subject.BATCH, facts, DECODE) is None  # the caller did not say: any DP pad is accepted
    ctx = DraftContext(
        backend="test",
        step_kinds=frozenset({DECODE}),
        capture=CaptureConfig(),
        dp_group=None,
        block_size=16,
        num_blocks=64,
        max_model_len=4096,
        max_num_seqs=16,
    )
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        ctx.check_batch(DECODE, facts)
    assert info.value.invariant_id == "AR-4" and info.value.observed["dp_size"] == 1
    ctx.check_batch(DECODE, decode_facts(num_reqs=12, model_tokens=12))


# -- BLK-8: survival is the running product of the confidences --------------------------------------------------------


def proposal_with(confidence: ConfidenceEvidence) -> ProposalFacts:
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=6, num_reqs=2, uniform_token_count=3)
    return ProposalFacts(
        desc=desc,
        num_reqs=2,
        num_spec_tokens=3,
        draft_token_ids=torch.zeros((2, 3), dtype=torch.int64),
        confidence=confidence,
    )


CONF = torch.tensor([[0.9, 0.5, 0.8], [1.0, 0.25, 0.5]])


def test_survival_that_is_the_product_of_the_confidences_passes() -> None:
    ev = ConfidenceEvidence(survival=CONF.cumprod(dim=1), confidence=CONF)
    assert violated(Subject.PROPOSAL, proposal_with(ev), BLOCK) is None


@pytest.mark.parametrize(
    "survival",
    [
        torch.cat([torch.ones(2, 1), CONF.cumprod(dim=1)[:, :-1]], dim=1),  # one slot late: still monotone
        CONF.cumprod(dim=1) * 0.5,  # scaled: still monotone and in [0, 1]
    ],
    ids=["shifted", "scaled"],
)
def test_survival_off_its_definition_is_blk_8_although_it_never_increases(survival: torch.Tensor) -> None:
    ev = ConfidenceEvidence(survival=survival, confidence=CONF)
    assert violated(Subject.PROPOSAL, proposal_with(ConfidenceEvidence(survival=survival)), BLOCK) is None
    assert violated(Subject.PROPOSAL, proposal_with(ev), BLOCK) == "BLK-8"


def test_survival_outside_zero_one_is_blk_8() -> None:
    ev = ConfidenceEvidence(survival=torch.tensor([[1.5, 1.2, 1.1], [0.5, 0.4, float("nan")]]))
    assert violated(Subject.PROPOSAL, proposal_with(ev), BLOCK) == "BLK-8"


# -- VER-8: a draft forward's logits are finite on its real rows -------------------------------------------------------


def test_non_finite_draft_logits_on_a_real_row_are_ver_8_padded_rows_are_not() -> None:
    logits = torch.randn(6, 10)
    logits[:, 3] = float("-inf")  # a masked token
    assert violated(Subject.FORWARD_OUTPUT, ForwardOutputFacts(num_tokens=4, logits=logits), DECODE) is None
    logits[5] = float("nan")  # a padded row: never sampled
    assert violated(Subject.FORWARD_OUTPUT, ForwardOutputFacts(num_tokens=4, logits=logits), DECODE) is None
    logits[2, 7] = float("nan")
    facts = ForwardOutputFacts(num_tokens=4, logits=logits)
    assert violated(Subject.FORWARD_OUTPUT, facts, DECODE, "shapes") is None  # a device read: full only
    assert violated(Subject.FORWARD_OUTPUT, facts, DECODE) == "VER-8"


def test_ver_8_reads_the_scored_rows_and_names_them_by_model_row() -> None:
    logits = torch.randn(2, 10)  # rows 1 and 3 of a 4-token forward, scored alone
    facts = ForwardOutputFacts(num_tokens=4, logits=logits, scored_rows=(1, 3))
    assert violated(Subject.FORWARD_OUTPUT, facts, DECODE) is None
    logits[1, 0] = float("inf")
    with contracts.enforce("full"), pytest.raises(ContractViolation) as err:
        check(Subject.FORWARD_OUTPUT, facts, step_kind=DECODE, component="test")
    assert err.value.invariant_id == "VER-8"
    assert "row 3" in str(err.value)  # the model row, not the position in the scored subset


# -- VER-11: a draft forward's logits hold exactly the rows it was asked to score ------------------------------------


@pytest.mark.parametrize("mode", ["shapes", "full"])
def test_scored_rows_past_the_real_tokens_or_out_of_order_are_ver_11(mode: str) -> None:
    def facts(rows: tuple[int, ...] | None, logit_rows: int) -> ForwardOutputFacts:
        return ForwardOutputFacts(num_tokens=12, logits=torch.zeros(logit_rows, 10), scored_rows=rows)

    assert violated(Subject.FORWARD_OUTPUT, facts((3, 7, 11), 3), DECODE, mode) is None
    assert violated(Subject.FORWARD_OUTPUT, facts((), 0), DECODE, mode) is None  # nobody samples: no LM head
    assert violated(Subject.FORWARD_OUTPUT, facts(None, 13), DECODE, mode) is None  # every model row, pad included
    # 12 real tokens padded to 13: the last request's row located in the padded layout points at the pad.
    assert violated(Subject.FORWARD_OUTPUT, facts((3, 7, 12), 3), DECODE, mode) == "VER-11"
    assert violated(Subject.FORWARD_OUTPUT, facts((7, 3), 2), DECODE, mode) == "VER-11"
    assert violated(Subject.FORWARD_OUTPUT, facts((3, 3), 2), DECODE, mode) == "VER-11"
    # A network that ignored the rows it was asked for, and one that returned fewer rows than tokens.
    assert violated(Subject.FORWARD_OUTPUT, facts((3, 7), 13), DECODE, mode) == "VER-11"
    assert violated(Subject.FORWARD_OUTPUT, facts(None, 11), DECODE, mode) == "VER-11"
    assert violated(Subject.FORWARD_OUTPUT, facts((3, 7, 12), 3), DECODE, "off") is None


# -- VER-9: the reported proposal is the drafter's logits under the request's settings --------------------------------

SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
]


def proposal_from(probs: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]) -> ProposalFacts:
    rows, k, _ = probs.shape
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=rows, num_reqs=rows, uniform_token_count=1)
    return ProposalFacts(
        desc=desc,
        num_reqs=rows,
        num_spec_tokens=k,
        draft_token_ids=torch.zeros((rows, k), dtype=torch.int64),
        draft_probs=probs,
        source=proposal_source(logits, (k,) * rows, params),
    )


def defined(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    rows, k, vocab = logits.shape
    per_slot = [p for p in params for _ in range(k)]
    return probabilities(logits.reshape(rows * k, vocab), per_slot).view(rows, k, vocab)


@pytest.mark.parametrize("seed", range(20))
def test_the_samplers_own_proposal_passes_ver_9(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((5, 3, 40), generator=g) * (1 + seed % 4)
    assert violated(Subject.PROPOSAL, proposal_from(defined(logits, SETTINGS), logits, SETTINGS), DECODE) is None


def test_a_proposal_drawn_at_the_wrong_temperature_is_ver_9() -> None:
    """The gap: a temperature-only batch whose drafter ignores the temperature and reports what it drew from."""
    logits = torch.randn((4, 2, 30), generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t) for t in (0.5, 0.7, 1.5, 2.0)]
    at_one = [SamplingParams(temperature=1.0)] * 4
    facts = proposal_from(defined(logits, at_one), logits, params)
    assert violated(Subject.PROPOSAL, facts, DECODE, "shapes") is None  # recomputing is a device read
    assert violated(Subject.PROPOSAL, facts, DECODE) == "VER-9"


def test_top_k_that_keeps_the_wrong_tokens_is_ver_9() -> None:
    logits = torch.randn((1, 1, 20), generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, top_k=3)]
    good = defined(logits, params)
    bad = torch.zeros_like(good)
    least = logits[0, 0].argsort()[:3]  # the three least likely tokens, renormalised
    bad[0, 0, least] = logits[0, 0, least].softmax(-1)
    assert violated(Subject.PROPOSAL, proposal_from(good, logits, params), DECODE) is None
    assert violated(Subject.PROPOSAL, proposal_from(bad, logits, params), DECODE) == "VER-9"


def test_a_greedy_row_not_one_hot_at_the_argmax_is_ver_9() -> None:
    logits = torch.randn((1, 1, 12), generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0)]
    wrong = torch.zeros((1, 1, 12))
    wrong[0, 0, int(logits[0, 0].argmin())] = 1.0
    assert violated(Subject.PROPOSAL, proposal_from(defined(logits, params), logits, params), DECODE) is None
    assert violated(Subject.PROPOSAL, proposal_from(wrong, logits, params), DECODE) == "VER-9"


def test_slots_past_a_rows_draft_count_are_not_checked() -> None:
    logits = torch.randn((2, 3, 16), generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.8)] * 2
    probs = defined(logits, params)
    probs[1] = 0.0  # a non-drafting row: its slots hold nothing
    facts = dataclasses.replace(proposal_from(probs, logits, params), source=proposal_source(logits, (3, 0), params))
    assert violated(Subject.PROPOSAL, facts, DECODE) is None


# -- VER-10: the recovered token is drawn from the normalised residual -------------------------------------------------


def sampled_verification(seed: int, swap: bool = False) -> tuple[VerifierFacts, VerifierOutput]:
    """A real sampled verification of 6 requests (K = 3), optionally re-labelled with a swapped residual."""
    from specdec.verifier import verify

    g = torch.Generator().manual_seed(seed)
    k, vocab, n = 3, 12, 6
    drafts = torch.randint(0, vocab, (n, k), generator=g)
    q = torch.softmax(torch.randn((n, k, vocab), generator=g) * 2, dim=-1)
    inp = VerifierInput(
        draft_token_ids=drafts,
        num_draft_tokens=torch.full((n,), k),
        target_logits=torch.randn((n * (k + 1), vocab), generator=g) * 2,
        draft_probs=q,
    )
    with contracts.enforce("full"):
        out = verify(
            inp,
            [SamplingParams(temperature=1.0)] * n,
            num_spec_tokens=k,
            num_draft_tokens=[k] * n,
            generator=g,
            sampled_from=q,
        )
    assert out.recovery is not None
    if swap:
        rec = out.recovery
        residual = (rec.proposal - rec.target).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        dist = torch.where(mass > 0, residual / mass, rec.target)
        out = dataclasses.replace(out, recovery=dataclasses.replace(rec, distribution=dist))
    return VerifierFacts(n, k, [k] * n, inp, out, sampled_from=q), out


@pytest.mark.parametrize("seed", range(5))
def test_the_verifiers_own_residual_passes_ver_10(seed: int) -> None:
    facts, _ = sampled_verification(seed)
    assert violated(Subject.VERIFIER, facts, StepKind.VERIFY) is None


def test_a_residual_with_the_wrong_sign_is_ver_10() -> None:
    facts, out = sampled_verification(0, swap=True)
    assert out.recovery is not None and bool((out.recovery.position < 3).any()), "no rejection to judge"
    assert violated(Subject.VERIFIER, facts, StepKind.VERIFY, "shapes") is None  # a device read: full only
    assert violated(Subject.VERIFIER, facts, StepKind.VERIFY) == "VER-10"


def test_a_residual_of_another_slots_q_is_ver_10() -> None:
    facts, out = sampled_verification(1)
    rec = out.recovery
    assert rec is not None
    i = int((rec.position < 3).nonzero()[0])
    q = rec.proposal.clone()
    q[i] = torch.softmax(torch.randn(q.shape[-1], generator=torch.Generator().manual_seed(9)), dim=-1)
    residual = (rec.target - q).clamp_min(0.0)
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual / residual.sum(-1, keepdim=True), rec.target)
    bad = dataclasses.replace(out, recovery=dataclasses.replace(rec, proposal=q, distribution=dist))
    assert violated(Subject.VERIFIER, dataclasses.replace(facts, verifier_output=bad), StepKind.VERIFY) == "VER-10"


def test_a_proposal_that_is_not_a_distribution_is_left_to_ver_6() -> None:
    """Top-k cut without renormalising breaks the definition too, but VER-6 names the more specific cause."""
    logits = torch.randn((1, 1, 20), generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_k=3)]
    unnormalised = torch.where(defined(logits, params) > 0, logits.softmax(-1), 0.0)
    assert violated(Subject.PROPOSAL, proposal_from(unnormalised, logits, params), DECODE) is None
