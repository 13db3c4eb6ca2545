"""VER-*: the rejection sampler's output is well-formed and uses the right proposal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.metadata import REJECTED_TOKEN_ID
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import VerifierFacts

VERIFY = {StepKind.VERIFY}
PROPOSAL_ATOL = 1e-5
"""Largest per-entry gap between two probability vectors still taken as the same distribution (fp32)."""


@invariant(
    "VER-1",
    "Output rows are (num_reqs, K + 1), 0 <= num_accepted_r <= num_draft_r, and entries past num_accepted_r + 1 hold the sentinel.",
    tag=Tag.SD,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the bonus token was dropped, or unused slots were left uninitialised",
)
def ver_1(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    out = facts.verifier_output
    if out is None:
        return None
    shape = tuple(out.output_token_ids.shape)
    if shape != (facts.num_reqs, facts.num_spec_tokens + 1) or out.num_accepted.shape[0] != facts.num_reqs:
        return {"output shape": shape, "expected": (facts.num_reqs, facts.num_spec_tokens + 1)}
    acc, rows = reader.device(out.num_accepted), reader.device(out.output_token_ids)
    if acc is None or rows is None:
        return None
    for r, (a, row) in enumerate(zip(acc, rows, strict=True)):
        d = facts.num_draft_tokens[r]
        emitted, unused = row[: a + 1], row[a + 1 :]
        if not 0 <= a <= d or any(t < 0 for t in emitted) or any(t != REJECTED_TOKEN_ID for t in unused):
            return {"request": r, "num_accepted": a, "num_draft": d, "output row": row}
    return None


@invariant(
    "VER-2",
    "A padded or sentinel draft id is never accepted.",
    tag=Tag.D,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="draft slots past num_draft_r were compared with the target instead of being masked",
)
def ver_2(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    out = facts.verifier_output
    if out is None:
        return None
    acc, drafts = reader.device(out.num_accepted), reader.device(facts.verifier_input.draft_token_ids)
    if acc is None or drafts is None:
        return None
    for r, a in enumerate(acc):
        accepted = drafts[r][:a]
        if a > facts.num_draft_tokens[r] or any(t < 0 for t in accepted):
            return {"request": r, "num_accepted": a, "num_draft": facts.num_draft_tokens[r], "draft row": drafts[r]}
    return None


@invariant(
    "VER-3",
    "The proposal distribution handed to the sampler is the one each draft token was drawn from.",
    tag=Tag.SD,
    subject=Subject.VERIFIER,
    step_kinds=VERIFY,
    likely_cause="the backbone distribution was passed instead of the corrected (e.g. Markov) one the drafts came from",
)
def ver_3(facts: VerifierFacts, reader: ValueReader) -> Observed | None:
    """[S] both present with one shape over the target's vocabulary; [D] equal values on every drafted slot."""
    given, drawn = facts.verifier_input.draft_probs, facts.sampled_from
    if given is None and drawn is None:
        return None
    if given is None or drawn is None or given.shape != drawn.shape:
        return {
            "given proposal": None if given is None else tuple(given.shape),
            "drawn from": None if drawn is None else tuple(drawn.shape),
            "problem": "the proposal handed over and the one drawn from differ in presence or shape",
        }
    vocab = facts.verifier_input.target_logits.shape[-1]
    if given.shape[-1] != vocab:
        return {"proposal vocab": given.shape[-1], "target vocab": vocab}
    if given is drawn or not reader.allow_device:
        return None
    # One reduction on the device, then a (num_reqs, K) read: the distributions are vocab-wide.
    differs = reader.device((given.float() - drawn.float()).abs().amax(dim=-1) > PROPOSAL_ATOL)
    if differs is None:
        return None
    for r, row in enumerate(differs):
        slots = [j for j, flag in enumerate(row[: facts.num_draft_tokens[r]]) if flag]
        if slots:
            gap = float((given[r, slots[0]].float() - drawn[r, slots[0]].float()).abs().max())
            return {
                "request": r,
                "draft slots": slots,
                "max |given - drawn|": round(gap, 6),
                "problem": "the proposal handed over is not the distribution the draft was drawn from",
            }
    return None
