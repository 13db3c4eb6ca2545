"""PROP-*: a proposal answers the target step it was drafted for, one row and one count per request.

Every backend's proposal is checked against these before its own family's
(AR-9, BLK-7, BLK-8): they read only host integers, so they are free, and the
engine also runs them with contracts ``off`` (``specdec.speculator.check_proposal``),
because a malformed proposal would otherwise mis-index the next verification.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import ProposalCountFacts

PROPOSAL = {StepKind.PROPOSAL}
MAX_LISTED = 8
"""Longest list of requests a message shows; the rest is counted."""
ROWS_FROM_PAD = (
    "the proposal was sized to the DP-padded request count (desc.num_reqs_padded, which includes requests that "
    "exist only to line up CUDA graphs or DP ranks) instead of the target step's num_reqs"
)


def _cut(items: list[Any]) -> list[Any] | str:
    if len(items) <= MAX_LISTED:
        return items
    return f"{items[:MAX_LISTED]} and {len(items) - MAX_LISTED} more"


def _is_count(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool)


@invariant(
    "PROP-1",
    "The proposal has exactly num_reqs draft rows: one per request of the target step, never the DP-padded count.",
    tag=Tag.S,
    subject=Subject.PROPOSAL,
    step_kinds=PROPOSAL,
    likely_cause="the draft ids were built for another batch (the previous step's, or only the drafting requests)",
)
def prop_1(facts: ProposalCountFacts, _: ValueReader) -> Observed | None:
    if facts.rows == facts.num_reqs:
        return None
    observed: Observed = {
        "draft rows": facts.rows,
        "num_reqs": facts.num_reqs,
        "num_reqs_padded": facts.num_reqs_padded,
    }
    if facts.rows == facts.num_reqs_padded:
        observed["likely_cause"] = ROWS_FROM_PAD
    return observed


@invariant(
    "PROP-2",
    "num_drafts is a host tuple holding one count per request of the target step (num_reqs entries).",
    tag=Tag.S,
    subject=Subject.PROPOSAL,
    step_kinds=PROPOSAL,
    likely_cause="counts were kept for the drafting requests only, or for another batch, instead of one per request "
    "(0 for a request that does not draft)",
)
def prop_2(facts: ProposalCountFacts, _: ValueReader) -> Observed | None:
    if facts.counts_type not in ("tuple", "list"):
        return {
            "num_drafts": facts.counts_type,
            "likely_cause": "the counts were returned as a tensor or other object, not a tuple of host ints "
            "(reading a device tensor's counts would be a hidden device sync)",
        }
    n = len(facts.num_drafts)
    if n == facts.num_reqs:
        return None
    observed: Observed = {"len(num_drafts)": n, "num_reqs": facts.num_reqs, "num_reqs_padded": facts.num_reqs_padded}
    if n == facts.num_reqs_padded:
        observed["likely_cause"] = ROWS_FROM_PAD
    elif n == sum(1 for d in facts.drafting if d):
        observed["likely_cause"] = (
            "counts were kept for the drafting requests only; every request needs one (0 if it does not draft)"
        )
    return observed


@invariant(
    "PROP-3",
    "Every draft count is an integer in [0, K].",
    tag=Tag.H,
    subject=Subject.PROPOSAL,
    step_kinds=PROPOSAL,
    likely_cause="the count included the bonus token (K + 1), was taken from another config's K, or was carried "
    "as a tensor or float instead of a host int",
)
def prop_3(facts: ProposalCountFacts, _: ValueReader) -> Observed | None:
    k = facts.num_spec_tokens
    bad = [
        (rid, n if _is_count(n) else f"{type(n).__name__} {n!r}")
        for rid, n in zip(facts.req_ids, facts.num_drafts, strict=False)
        if not _is_count(n) or not 0 <= n <= k
    ]
    if not bad:
        return None
    return {"(request, count)": _cut(bad), "K": k}


@invariant(
    "PROP-4",
    "A request that does not draft for the next step (finished, or still in prefill) has 0 drafts.",
    tag=Tag.H,
    subject=Subject.PROPOSAL,
    step_kinds=PROPOSAL,
    likely_cause="the drafter ignored step.drafting and drafted for every request: a finished request, or one whose "
    "prompt is still being prefilled in chunks, cannot verify drafts",
)
def prop_4(facts: ProposalCountFacts, _: ValueReader) -> Observed | None:
    bad = [
        (rid, n)
        for rid, n, drafting in zip(facts.req_ids, facts.num_drafts, facts.drafting, strict=False)
        if not drafting and _is_count(n) and n != 0
    ]
    if not bad:
        return None
    return {"(request, count)": _cut(bad), "non-drafting requests": sum(1 for d in facts.drafting if not d)}
