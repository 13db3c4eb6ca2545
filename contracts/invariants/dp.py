"""DP-*: every rank leaves the sync with the same result and consistent token counts."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import DPFacts


_PURPOSE_NAMES: dict[int, str] = {}
"""Every purpose this process has tagged, by tag: how DP-3 names the syncs that its ranks paired."""

ENGINE_PURPOSE = "target"
"""The purpose of the engine's own sync of every step; drafters' syncs carry their own names."""


def purpose_tag(name: str) -> int:
    """A stable integer for a sync's purpose ("target", "draft", ...), exchanged with the counts.

    The name is remembered, so a DP-3 message names the purposes its ranks synced for.
    """
    tag = zlib.crc32(name.encode())
    _PURPOSE_NAMES[tag] = name
    return tag


def purpose_name(tag: int) -> str:
    """The name behind ``tag``, or a note that this process never synced for it (a peer's own purpose)."""
    name = _PURPOSE_NAMES.get(tag)
    return name if name is not None else f"<purpose tag {tag}, never synced by this process>"


def _quoted(tag: int) -> str:
    return repr(_PURPOSE_NAMES[tag]) if tag in _PURPOSE_NAMES else purpose_name(tag)


purpose_tag(ENGINE_PURPOSE)


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
        return {
            "rank": facts.rank,
            "collectives run before this sync, per rank": [n for n, _ in seqs],
            "purpose per rank": [purpose_name(tag) for _, tag in seqs],
            "diverged": diverged_ranks(seqs),
        }
    peers = facts.peer_states
    if peers is not None and any(p != facts.state for p in peers):
        return {"rank": facts.rank, "sync results": [repr(p) for p in peers]}
    return None


def diverged_ranks(seqs: tuple[tuple[int, int], ...]) -> str:
    """Which ranks left the others' sequence of collectives, and how, in words.

    The reference is the largest group of ranks that agree on (collectives run,
    purpose); on a tie, the group that ran more collectives, then the one not at
    the engine's own sync: a rank that skipped a drafter's sync arrives early at
    the next step's engine sync, with fewer collectives behind it.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, key in enumerate(seqs):
        groups.setdefault(key, []).append(rank)
    engine = purpose_tag(ENGINE_PURPOSE)
    order = sorted(groups, key=lambda k: (-len(groups[k]), -k[0], k[1] == engine, groups[k][0]))
    ref_n, ref_tag = order[0]
    ref = _ranks(groups[order[0]])
    sentences = []
    for n, tag in order[1:]:
        who = _ranks(groups[(n, tag)])
        if n != ref_n:
            fewer = n < ref_n
            purposes = f", and synced for {_quoted(tag)} where {ref} synced for {_quoted(ref_tag)}"
            sentences.append(
                f"{who} ran {abs(ref_n - n)} {'fewer' if fewer else 'more'} collective(s) than {ref} before this sync "
                f"({'skipped one its peers ran' if fewer else 'ran one its peers skipped'})"
                + (purposes if tag != ref_tag else f", both at a {_quoted(tag)} sync")
            )
        else:
            skipped = f": it skipped the {_quoted(ref_tag)} sync" if tag == engine != ref_tag else ""
            sentences.append(f"{who} synced for {_quoted(tag)} where {ref} synced for {_quoted(ref_tag)}{skipped}")
    return "; ".join(sentences)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
