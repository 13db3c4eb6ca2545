"""TGT-*: the target model's padded batch and its attention metadata.

The padded-request rules every forward shares (zero-length queries, seq_len 0, the block
table's rows, PAD slots) are PAD-1..PAD-3 and KV-3; TGT-2, TGT-3 and TGT-5 were those rules for
the target alone and are retired, their IDs unused.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from contracts.invariants.padded_requests import read_mirrored
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import BatchFacts, VerifierFacts

TARGET = {StepKind.TARGET}


@invariant(
    "TGT-1",
    "Target input_ids and positions have length desc.num_tokens.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="model inputs were sized from the real token count instead of the padded descriptor",
)
def tgt_1(facts: BatchFacts, _: ValueReader) -> Observed | None:
    n = facts.desc.num_tokens
    if facts.input_ids.shape[0] != n or facts.positions.shape[0] != n:
        return {
            "len(input_ids)": facts.input_ids.shape[0],
            "len(positions)": facts.positions.shape[0],
            "desc.num_tokens": n,
        }
    return None


@invariant(
    "TGT-4",
    "Real target slots are unique, non-negative and inside their request's blocks (padded rows: KV-3).",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="slots were computed from the wrong block table row, or two tokens were given one slot",
)
def tgt_4(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    slots = reader.device(meta.slot_mapping)
    if slots is None:
        return None
    real = slots[: facts.num_tokens]
    if len(set(real)) != len(real) or any(s < 0 for s in real):
        return {
            "slot_mapping": slots,
            "real tokens": facts.num_tokens,
            "problem": "real slots must be unique and non-negative",
        }
    if facts.block_size is None:
        return None
    qsl, _ = read_mirrored(reader, meta.query_start_loc, meta.query_start_loc_cpu)
    seq, _ = read_mirrored(reader, meta.seq_lens, meta.seq_lens_cpu)
    table = reader.device(meta.block_table)
    if qsl is None or seq is None or table is None:
        return None
    for r in range(facts.num_reqs):
        # Only the blocks that hold this request's context count; filler columns do not.
        owned = set(table[r][: -(-seq[r] // facts.block_size)])
        outside = [s for s in real[qsl[r] : qsl[r + 1]] if s // facts.block_size not in owned]
        if outside:
            return {"request": r, "slots outside its blocks": outside, "block_table row": table[r]}
    return None


@invariant(
    "TGT-6",
    "Target logits have sum(num_draft_r + 1) rows over real requests, with every num_draft_r <= K.",
    tag=Tag.S,
    subject=Subject.VERIFIER,
    step_kinds={StepKind.VERIFY},
    likely_cause="logits were gathered for padded requests, or a request proposed more drafts than K",
)
def tgt_6(facts: VerifierFacts, _: ValueReader) -> Observed | None:
    drafts = list(facts.num_draft_tokens)
    rows = facts.verifier_input.target_logits.shape[0]
    if (
        len(drafts) != facts.num_reqs
        or rows != sum(d + 1 for d in drafts)
        or any(d > facts.num_spec_tokens or d < 0 for d in drafts)
    ):
        return {"logits rows": rows, "num_draft_tokens": drafts, "num_reqs": facts.num_reqs, "K": facts.num_spec_tokens}
    return None


@invariant(
    "TGT-7",
    "Target attention metadata counts match the batch: num_reqs and num_tokens real, num_tokens_padded == desc.num_tokens under FULL and the real token count otherwise, max_query_len at least the longest query.",
    tag=Tag.SH,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="the metadata builder was given counts from another padding level",
    accepts="a max_query_len above the longest query (an upper bound, as kernels use it: vLLM's adaptive verification "
    "passes the scheduled bound)",
)
def tgt_7(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    observed: Observed = {
        "meta.num_reqs": meta.num_reqs,
        "meta.num_tokens": meta.num_tokens,
        "meta.num_tokens_padded": meta.num_tokens_padded,
        "meta.max_query_len": meta.max_query_len,
        "real num_reqs": facts.num_reqs,
        "real num_tokens": facts.num_tokens,
        "desc.num_tokens": facts.desc.num_tokens,
    }
    attention_rows = facts.desc.num_tokens if facts.desc.cg_mode.name == "FULL" else facts.num_tokens
    if (meta.num_reqs, meta.num_tokens, meta.num_tokens_padded) != (facts.num_reqs, facts.num_tokens, attention_rows):
        return {**observed, "expected attention rows": attention_rows}
    qsl = reader.host(meta.query_start_loc_cpu)
    if qsl is not None and len(qsl) > 1:
        longest = max(b - a for a, b in itertools.pairwise(qsl))
        if meta.max_query_len < longest:
            return {**observed, "longest query": longest}
    return None
