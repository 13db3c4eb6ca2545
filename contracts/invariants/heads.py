"""HEAD-*: a KV-less draft forward, heads on the target's hidden states with one row per drafting request.

Such a forward has no attention metadata, so the AR invariants that read it do
not apply; what remains is the step's shape: one row per drafting request,
padded only by the DP pad, and inputs with exactly the rows every rank agreed on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.invariants.autoregressive import one_row_per_request
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import HeadFacts

HEADS = {StepKind.DRAFT_HEADS}


@invariant(
    "HEAD-1",
    "A heads forward runs FULL or NONE with one row per real request: uniform_token_count is 1 when set; under FULL "
    "desc.num_tokens == desc.num_reqs; under eager the rows exceed num_reqs only by a DP pad, so without DP (dp_size 1) "
    "desc.num_tokens == num_reqs.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=HEADS,
    likely_cause="the heads ran with another step's descriptor (the target's piecewise or verify-shaped one) instead "
    "of their own one-row-per-request draft sync",
    accepts="an eager descriptor with uniform_token_count None; eager rows past num_reqs when DP is on or dp_size is "
    "not given (a pad to the largest rank's count, an idle rank's dummy step)",
)
def head_1(facts: HeadFacts, _: ValueReader) -> Observed | None:
    d = facts.desc
    if d.cg_mode.name == "PIECEWISE":
        return {"cg_mode": d.cg_mode.name, "likely_cause": "a piecewise descriptor (the target's) was reused"}
    return one_row_per_request(d, facts.num_reqs, facts.dp_size, "heads")


@invariant(
    "HEAD-2",
    "The heads' input hidden states have desc.num_tokens rows: the drafting requests' rows, then the DP pad (an idle "
    "rank's dummy rows included).",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=HEADS,
    likely_cause="the hidden states were gathered for the drafting requests only (none on an idle rank) instead of "
    "padded to desc.num_tokens, so this rank's rows differ from what every rank agreed and DP collectives would not "
    "line up",
)
def head_2(facts: HeadFacts, _: ValueReader) -> Observed | None:
    h = facts.hidden_states
    if h.shape[0] != facts.desc.num_tokens:
        return {
            "hidden_states shape": tuple(h.shape),
            "desc.num_tokens": facts.desc.num_tokens,
            "num_reqs": facts.num_reqs,
        }
    return None
