"""DP-*: every rank leaves the sync with the same result and consistent token counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import DPFacts


@invariant(
    "DP-1",
    "num_tokens_across_dp has dp_size entries and, unless every rank runs eager, each equals desc.num_tokens.",
    tag=Tag.H,
    subject=Subject.DP,
    step_kinds={StepKind.DP_SYNC},
    likely_cause="a rank re-dispatched with its own token count instead of the DP maximum",
)
def dp_1(facts: DPFacts, _: ValueReader) -> Observed | None:
    across = facts.state.num_tokens_across_dp
    observed: Observed = {
        "dp_size": facts.state.dp_size,
        "num_tokens_across_dp": list(across),
        "desc.num_tokens": facts.desc.num_tokens,
        "synced cg_mode": facts.state.cg_mode.name,
    }
    if len(across) != facts.state.dp_size:
        return observed
    if facts.state.cg_mode.name != "NONE" and any(n != facts.desc.num_tokens for n in across):
        return observed
    return None


@invariant(
    "DP-2",
    "When every rank runs eager, this rank's entry equals its unpadded token count and desc.num_tokens.",
    tag=Tag.H,
    subject=Subject.DP,
    step_kinds={StepKind.DP_SYNC},
    likely_cause="an eager rank kept DP padding that only graph replay needs",
)
def dp_2(facts: DPFacts, _: ValueReader) -> Observed | None:
    if facts.state.cg_mode.name != "NONE":
        return None
    across = facts.state.num_tokens_across_dp
    entry = across[facts.rank] if 0 <= facts.rank < len(across) else None
    if entry != facts.num_tokens or facts.desc.num_tokens != facts.num_tokens:
        return {
            "rank": facts.rank,
            "num_tokens_across_dp[rank]": entry,
            "local num_tokens": facts.num_tokens,
            "desc.num_tokens": facts.desc.num_tokens,
        }
    return None


@invariant(
    "DP-3",
    "The sync result is identical on every rank and every rank has run the same number of collectives.",
    tag=Tag.X,
    subject=Subject.DP,
    step_kinds={StepKind.DP_SYNC},
    likely_cause="a rank skipped (or added) a collective, e.g. skipped drafting while its peers drafted",
)
def dp_3(facts: DPFacts, _: ValueReader) -> Observed | None:
    seqs = facts.collective_seqs
    if seqs is not None and len(set(seqs)) > 1:
        return {"rank": facts.rank, "(collectives run, purpose tag) per rank": list(seqs)}
    peers = facts.peer_states
    if peers is not None and any(p != facts.state for p in peers):
        return {"rank": facts.rank, "sync results": [repr(p) for p in peers]}
    return None
