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
    "When every rank runs eager, this rank's entry equals desc.num_tokens and is at least its unpadded token count; "
    "it exceeds that count only as a pad common to every rank (all entries equal).",
    tag=Tag.H,
    subject=Subject.DP,
    step_kinds={StepKind.DP_SYNC},
    likely_cause="an eager rank runs a token count other than the one its peers were told, or kept a graph pad alone",
    accepts="eager entries padded alike on every rank (a draft step whose collectives need equal rows, "
    "or microbatched eager steps); an idle rank's one-token dummy step counted as its own tokens",
)
def dp_2(facts: DPFacts, _: ValueReader) -> Observed | None:
    if facts.state.cg_mode.name != "NONE":
        return None
    across = facts.state.num_tokens_across_dp
    entry = across[facts.rank] if 0 <= facts.rank < len(across) else None
    padded_alone = entry != facts.num_tokens and len(set(across)) != 1
    if entry is None or entry != facts.desc.num_tokens or entry < facts.num_tokens or padded_alone:
        return {
            "rank": facts.rank,
            "num_tokens_across_dp": list(across),
            "num_tokens_across_dp[rank]": entry,
            "local num_tokens": facts.num_tokens,
            "desc.num_tokens": facts.desc.num_tokens,
        }
    return None


@invariant(
    "DP-3",
    "The sync result is identical on every rank and every rank has run the same number of collectives "
    "(checked where the collective counters or every rank's result are known; without them DP-3 passes).",
    tag=Tag.X,
    subject=Subject.DP,
    step_kinds={StepKind.DP_SYNC},
    likely_cause="a rank skipped (or added) a collective, e.g. skipped drafting while its peers drafted",
    accepts="a sync result with no collective counter and no view of its peers (vLLM's): nothing to compare, so it passes",
)
def dp_3(facts: DPFacts, _: ValueReader) -> Observed | None:
    seqs = facts.collective_seqs
    if seqs is not None and len(set(seqs)) > 1:
        return {"rank": facts.rank, "(collectives run, purpose tag) per rank": list(seqs)}
    peers = facts.peer_states
    if peers is not None and any(p != facts.state for p in peers):
        return {"rank": facts.rank, "sync results": [repr(p) for p in peers]}
    return None
