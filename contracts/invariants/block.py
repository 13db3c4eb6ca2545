"""BLK-*: block drafters (DFlash, DSpark) run q queries per request in one forward."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from contracts.metadata import PAD_SLOT_ID
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.evidence import CapacityEvidence, ConfidenceEvidence, MarkovChainEvidence
    from contracts.facts import BatchFacts, ProposalFacts

BLOCK = {StepKind.DRAFT_BLOCK}
SURVIVAL_ATOL = 1e-5
"""Largest gap between a reported survival and the product of its confidences (float32 rounding over K factors)."""
DP_PAD_LEAK = (
    "DP padding leaked into block-drafter attention metadata: the attention token count was built from "
    "desc.num_tokens outside FULL mode instead of num_reqs * q"
)


def _q(facts: BatchFacts) -> int:
    return facts.meta.query_width or 0


@invariant(
    "BLK-1",
    "The query width q is 1 + N for the bonus-first layout (DFlash) and N or 1 + N for anchor-first (DSpark).",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
)
def blk_1(facts: BatchFacts, _: ValueReader) -> Observed | None:
    q, n = _q(facts), facts.num_spec_tokens
    if n is None:
        return None
    allowed = {n + 1} if facts.block_layout != "anchor_first" else {n, n + 1}
    if q not in allowed:
        return {"query_width": q, "N": n, "layout": facts.block_layout, "allowed": sorted(allowed)}
    return None


@invariant(
    "BLK-2",
    "A block step with tokens runs q queries per request: uniform_token_count is q when set; under FULL desc.num_tokens == desc.num_reqs * q; "
    "under eager the model rows are at least num_reqs * q, and exactly that without DP (dp_size 1). An empty step, where no rank drafts, only injects context.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
    likely_cause="the block step was dispatched for another query width (a one-query or verify-shaped batch)",
    accepts="an eager (or graph-fallback) descriptor with uniform_token_count None; eager model rows past num_reqs * q "
    "when DP is on or dp_size is not given (a pad to the largest rank's count)",
)
def blk_2(facts: BatchFacts, _: ValueReader) -> Observed | None:
    d, q = facts.desc, _q(facts)
    if d.num_tokens == 0:
        return None
    queries = facts.num_reqs * q
    full_bad = d.cg_mode.name == "FULL" and d.num_reqs is not None and d.num_tokens != d.num_reqs * q
    eager_bad = d.cg_mode.name == "NONE" and (
        d.num_tokens < queries or (facts.dp_size == 1 and d.num_tokens != queries)
    )
    if d.uniform_token_count not in (None, q) or full_bad or eager_bad:
        return {
            "cg_mode": d.cg_mode.name,
            "uniform_token_count": d.uniform_token_count,
            "q": q,
            "desc.num_tokens": d.num_tokens,
            "desc.num_reqs": d.num_reqs,
            "num_reqs * q": queries,
            "dp_size": facts.dp_size,
        }
    return None


@invariant(
    "BLK-3",
    "Block attention has desc.num_tokens query rows under FULL and num_reqs * q otherwise, with max_query_len == q.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
    likely_cause=DP_PAD_LEAK,
)
def blk_3(facts: BatchFacts, _: ValueReader) -> Observed | None:
    d, meta, q = facts.desc, facts.meta, _q(facts)
    want = d.num_tokens if d.cg_mode.name == "FULL" else facts.num_reqs * q
    if meta.num_tokens_padded != want or meta.max_query_len != q:
        observed: Observed = {
            "meta.num_tokens_padded": meta.num_tokens_padded,
            "expected attention tokens": want,
            "meta.max_query_len": meta.max_query_len,
            "q": q,
            "desc.num_tokens": d.num_tokens,
            "num_reqs": facts.num_reqs,
        }
        if meta.num_tokens_padded != d.num_tokens or d.num_tokens == want:
            observed["likely_cause"] = "block metadata was built for another batch shape"
        return observed
    return None


@invariant(
    "BLK-4",
    "Block query_start_loc[r] == r * q for r <= num_reqs and num_reqs * q after.",
    tag=Tag.SH,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
    likely_cause="padded requests were given queries (they must be zero-length)",
)
def blk_4(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta, q = facts.meta, _q(facts)
    qsl = reader.host(meta.query_start_loc_cpu)
    if qsl is None:
        qsl = reader.device(meta.query_start_loc)
    if qsl is None:
        return None
    want = [min(r, facts.num_reqs) * q for r in range(len(qsl))]
    if qsl != want:
        return {"query_start_loc": qsl, "expected": want}
    return None


@invariant(
    "BLK-5",
    "Block query positions are last_valid + 1 + j and seq_lens == last_valid + 1 + q, clamped to max_model_len.",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
    likely_cause="the block was placed at the last verified position instead of after it (off by one)",
)
def blk_5(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    if facts.base_positions is None or facts.max_model_len is None:
        return None
    base, pos, seq = (reader.device(t) for t in (facts.base_positions, facts.positions, facts.meta.seq_lens))
    if base is None or pos is None or seq is None:
        return None
    q, top = _q(facts), facts.max_model_len - 1
    want_pos = [min(b + 1 + j, top) for b in base[: facts.num_reqs] for j in range(q)]
    want_seq = [min(b + 1 + q, facts.max_model_len) for b in base[: facts.num_reqs]]
    if pos[: len(want_pos)] != want_pos or seq[: facts.num_reqs] != want_seq:
        return {
            "positions": pos[: len(want_pos)],
            "expected positions": want_pos,
            "seq_lens": seq[: facts.num_reqs],
            "expected seq_lens": want_seq,
        }
    return None


@invariant(
    "BLK-6",
    "Padded query rows and rejected context rows hold PAD_SLOT_ID; a real block row holds PAD_SLOT_ID or the slot of its own "
    "(speculative) position in its own request's blocks, never another slot.",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=BLOCK,
    likely_cause="rejected or padded rows would write into the draft KV cache",
    accepts="block rows cached at their own positions past the committed context (the next step overwrites them), "
    "checked when block_size is given; without it every block row must hold PAD_SLOT_ID",
)
def blk_6(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    slots = reader.device(facts.meta.slot_mapping)
    if slots is not None:
        wrong = _block_rows_writing_elsewhere(facts, slots, reader)
        if wrong:
            return {
                "(block row, slot) written": wrong,
                "block slot_mapping": slots,
                "block_size": facts.block_size,
                "problem": "a block row may write only its own position's slot in its own request's blocks, "
                "a padded row none",
            }
    ctx = reader.device(facts.context_slot_mapping)
    ok = reader.device(facts.context_committed)
    if ctx is None or ok is None:
        return None
    bad = [i for i, (s, keep) in enumerate(zip(ctx, ok, strict=True)) if not keep and s != PAD_SLOT_ID]
    if bad:
        return {"context rows not committed but written": bad, "context slot_mapping": ctx}
    return None


def _block_rows_writing_elsewhere(facts: BatchFacts, slots: list[int], reader: ValueReader) -> list[tuple[int, int]]:
    """(row, slot) of every block row that writes a slot other than its own position's in its own blocks."""
    live = [(row, s) for row, s in enumerate(slots) if s != PAD_SLOT_ID]
    q, bs = _q(facts), facts.block_size
    if not live or bs is None or q <= 0:
        return live
    pos, table = reader.device(facts.positions), reader.device(facts.meta.block_table)
    if pos is None or table is None:
        return live
    wrong = []
    for row, s in live:
        r, p = row // q, pos[row] if row < len(pos) else -1
        own = r < facts.num_reqs and p >= 0 and p // bs < len(table[r]) and s == table[r][p // bs] * bs + p % bs
        if not own:
            wrong.append((row, s))
    return wrong


@invariant(
    "BLK-7",
    "Exactly num_reqs * N block rows are sampled (num_reqs: the block step's drafting requests; the proposal's own rows are PROP-1's), all inside [0, desc.num_tokens).",
    tag=Tag.SD,
    subject=Subject.PROPOSAL,
    step_kinds=BLOCK,
    likely_cause="padded requests were sampled, or sample indices were computed for a DP-padded layout",
)
def blk_7(facts: ProposalFacts, reader: ValueReader) -> Observed | None:
    idx_t = facts.sample_indices
    if idx_t is None:
        return None
    want = facts.num_reqs * facts.num_spec_tokens
    if idx_t.shape[0] != want:
        return {"sampled rows": idx_t.shape[0], "num_reqs * N": want}
    idx = reader.device(idx_t)
    if idx is not None and any(not 0 <= i < facts.desc.num_tokens for i in idx):
        return {"sample_indices": idx, "desc.num_tokens": facts.desc.num_tokens}
    return None


@invariant(
    "BLK-8",
    "Drafter evidence holds: a Markov chain starts at the anchor, capacities lie in [0, N] and form a prefix, survival "
    "lies in [0, 1] and never increases, and where per-draft confidences are reported survival is their running "
    f"product (within {SURVIVAL_ATOL}).",
    tag=Tag.D,
    subject=Subject.PROPOSAL,
    step_kinds=BLOCK,
    likely_cause="Markov chain seeded with the wrong token, capacity selection produced a non-prefix mask, or the "
    "survival was not the product of the confidences up to its draft (shifted by one slot, or the last factor missed)",
)
def blk_8(facts: ProposalFacts, reader: ValueReader) -> Observed | None:
    """Runs on whichever capability evidence the proposal carries (``contracts.evidence``), for any backend."""
    found: list[Observed | None] = []
    if facts.markov is not None:
        found.append(_markov_starts_at_anchor(facts.markov, reader))
    if facts.capacity is not None:
        found.append(_capacity_is_prefix(facts.capacity, facts.num_spec_tokens, reader))
    if facts.confidence is not None:
        found.append(_survival_never_increases(facts.confidence, reader))
    return next((o for o in found if o is not None), None)


def _markov_starts_at_anchor(chain: MarkovChainEvidence, reader: ValueReader) -> Observed | None:
    prev, anchor = reader.device(chain.prev_token_ids), reader.device(chain.anchor_token_ids)
    if prev is not None and anchor is not None and [row[0] for row in prev] != anchor[: len(prev)]:
        return {"markov first tokens": [row[0] for row in prev], "anchors": anchor}
    return None


def _capacity_is_prefix(evidence: CapacityEvidence, n: int, reader: ValueReader) -> Observed | None:
    cap, mask = reader.device(evidence.capacity), reader.device(evidence.prefix_mask)
    if cap is None or mask is None:
        return None
    if any(not 0 <= c <= n for c in cap):
        return {"draft_capacity": cap, "N": n}
    for r, row in enumerate(mask):
        k = sum(bool(x) for x in row)
        if list(map(bool, row)) != [True] * k + [False] * (len(row) - k) or k != cap[r]:
            return {"request": r, "draft_mask row": row, "capacity": cap[r]}
    return None


def _survival_never_increases(evidence: ConfidenceEvidence, reader: ValueReader) -> Observed | None:
    surv = reader.device(evidence.survival)
    if surv is None:
        return None
    if any(not 0.0 <= a <= 1.0 for row in surv for a in row):
        return {"survival": surv, "problem": "a survival probability outside [0, 1] (NaN included)"}
    if any(b > a + SURVIVAL_ATOL for row in surv for a, b in itertools.pairwise(row)):
        return {"survival": surv, "problem": "survival increases along the drafts"}
    if evidence.confidence is None:
        return None
    conf = evidence.confidence
    if tuple(conf.shape) != tuple(evidence.survival.shape):
        return {"confidence shape": tuple(conf.shape), "survival shape": tuple(evidence.survival.shape)}
    # The definition, computed here from the reported factors in float64 (one small (m, K) tensor).
    product = reader.device(conf.double().cumprod(dim=-1))
    if product is None:
        return None
    off = [(r, j) for r, row in enumerate(surv) for j, a in enumerate(row) if abs(a - product[r][j]) > SURVIVAL_ATOL]
    if off:
        r = off[0][0]
        return {
            "(request, draft)": off[:8],
            "count": len(off),
            f"survival[{r}]": surv[r],
            f"running product of confidence[{r}]": [round(x, 6) for x in product[r]],
            "problem": "survival is not the product of the confidences up to its draft",
        }
    return None
