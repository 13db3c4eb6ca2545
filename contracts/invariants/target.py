"""TGT-*: the target model's padded batch and its attention metadata."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from contracts.metadata import PAD_SLOT_ID
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


def query_start_loc_problem(qsl: list[int], num_reqs: int, num_tokens: int) -> str | None:
    """Why ``qsl`` is not a valid padded prefix sum (padded requests empty), or None."""
    if not qsl or qsl[0] != 0:
        return "does not start at 0"
    if any(b < a for a, b in itertools.pairwise(qsl)):
        return "decreases (a padded entry of -1?)"
    if any(v != num_tokens for v in qsl[num_reqs:]):
        return f"entries from num_reqs on must all equal the real token count {num_tokens}"
    return None


def read_mirrored(reader: ValueReader, device_tensor: object, host_mirror: object) -> tuple[list[int] | None, bool]:
    """Values of a tensor with an optional host mirror, and whether the two disagree.

    The mirror is read first (free in every mode); in ``full`` the device tensor
    is read too, so a builder whose mirror is right but whose device copy is not
    cannot hide behind the mirror.
    """
    host = reader.host(host_mirror)
    dev = reader.device(device_tensor)
    if host is not None and dev is not None and host != dev:
        return dev, True
    return (host if host is not None else dev), False


@invariant(
    "TGT-2",
    "query_start_loc has num_reqs_padded + 1 entries, starts at 0, never decreases, and its tail equals the real token count.",
    tag=Tag.SH,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="padded requests were given -1 or non-empty query ranges",
)
def tgt_2(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    rows = facts.desc.num_reqs_padded(facts.num_reqs)
    if meta.num_reqs_padded != rows or meta.query_start_loc.shape[0] != rows + 1:
        return {
            "num_reqs_padded": rows,
            "meta.num_reqs_padded": meta.num_reqs_padded,
            "len(query_start_loc)": meta.query_start_loc.shape[0],
        }
    qsl, split = read_mirrored(reader, meta.query_start_loc, meta.query_start_loc_cpu)
    if split:
        return {
            "query_start_loc": qsl,
            "query_start_loc_cpu": reader.host(meta.query_start_loc_cpu),
            "problem": "device tensor and host mirror differ",
        }
    if qsl is not None:
        problem = query_start_loc_problem(qsl, facts.num_reqs, facts.num_tokens)
        if problem is not None:
            return {"query_start_loc": qsl, "problem": problem}
    return None


@invariant(
    "TGT-3",
    "seq_lens has num_reqs_padded entries, 0 for padded requests, and seq_len >= query_len for real ones.",
    tag=Tag.SD,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="padded requests were given a context length, or the new tokens were not counted",
)
def tgt_3(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    rows = facts.desc.num_reqs_padded(facts.num_reqs)
    if meta.seq_lens.shape[0] != rows:
        return {"len(seq_lens)": meta.seq_lens.shape[0], "num_reqs_padded": rows}
    seq, split = read_mirrored(reader, meta.seq_lens, meta.seq_lens_cpu)
    if split:
        return {
            "seq_lens": seq,
            "seq_lens_cpu": reader.host(meta.seq_lens_cpu),
            "problem": "device tensor and host mirror differ",
        }
    qsl, _ = read_mirrored(reader, meta.query_start_loc, meta.query_start_loc_cpu)
    if seq is None or qsl is None:
        return None
    if len(seq) != rows or len(qsl) != rows + 1:
        return {
            "seq_lens": seq,
            "query_start_loc": qsl,
            "num_reqs_padded": rows,
            "problem": "a host mirror is sized wrongly",
        }
    n = facts.num_reqs
    if any(s != 0 for s in seq[n:]):
        return {"seq_lens": seq, "problem": "padded requests must have seq_len 0"}
    short = [r for r in range(n) if seq[r] < qsl[r + 1] - qsl[r]]
    if short:
        return {"seq_lens": seq, "query_start_loc": qsl, "requests with seq_len < query_len": short}
    return None


@invariant(
    "TGT-4",
    "slot_mapping has desc.num_tokens entries, PAD_SLOT_ID past the real tokens, and real slots unique and inside their request's blocks.",
    tag=Tag.SD,
    subject=Subject.BATCH,
    step_kinds=TARGET,
    likely_cause="padded rows would write KV into live blocks, or slots were computed from the wrong block table row",
)
def tgt_4(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    meta = facts.meta
    if meta.slot_mapping.shape[0] != facts.desc.num_tokens:
        return {"len(slot_mapping)": meta.slot_mapping.shape[0], "desc.num_tokens": facts.desc.num_tokens}
    slots = reader.device(meta.slot_mapping)
    if slots is None:
        return None
    n = facts.num_tokens
    if any(s != PAD_SLOT_ID for s in slots[n:]):
        return {"slot_mapping": slots, "real tokens": n, "problem": "padded rows must hold PAD_SLOT_ID (-1)"}
    real = slots[:n]
    if len(set(real)) != len(real) or any(s < 0 for s in real):
        return {"slot_mapping": slots, "problem": "real slots must be unique and non-negative"}
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
    "TGT-5",
    "block_table has num_reqs_padded rows.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=TARGET,
)
def tgt_5(facts: BatchFacts, _: ValueReader) -> Observed | None:
    rows = facts.desc.num_reqs_padded(facts.num_reqs)
    if facts.meta.block_table.shape[0] != rows:
        return {"block_table rows": facts.meta.block_table.shape[0], "num_reqs_padded": rows}
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
