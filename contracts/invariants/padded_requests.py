"""PAD-*: padded requests are empty in every forward's metadata, target or draft.

A CUDA graph (or a DP peer) pads a batch with requests that do not exist. Every
forward of a step, the target's and each drafter's, must keep them inert the same
way: a zero-length query, ``seq_len`` 0 and a block-table row no kernel reads
(the padded rows' KV slots, PAD_SLOT_ID, are KV-3's). One statement per rule, for
all four forward kinds, so a drafter's metadata is held to the target's standard.

Host mirrors are read in every mode (free); device tensors only in ``full``. The
family is checked after the step kind's own invariants (it sorts after the named
families), so where both fire the more specific cause is named: a verify-shaped
draft decode descriptor is AR-4, not "padded requests got queries".
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import BatchFacts

FORWARDS = {StepKind.TARGET, StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK}


def query_start_loc_problem(qsl: list[int], num_reqs: int, num_tokens: int) -> str | None:
    """Why ``qsl`` is not a valid padded prefix sum (padded requests empty), or None."""
    if not qsl or qsl[0] != 0:
        return "does not start at 0"
    if any(b < a for a, b in itertools.pairwise(qsl)):
        return "decreases (a padded entry of -1?)"
    if any(v != num_tokens for v in qsl[num_reqs:]):
        return f"entries from num_reqs on must all equal the real query count {num_tokens}"
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
    "PAD-1",
    "query_start_loc has num_reqs_padded + 1 entries, starts at 0, never decreases, and is flat from num_reqs on at "
    "the real query count: a padded request has a zero-length query.",
    tag=Tag.SH,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="padded requests were given -1 or non-empty query ranges",
)
def pad_1(facts: BatchFacts, reader: ValueReader) -> Observed | None:
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
    "PAD-2",
    "seq_lens has num_reqs_padded entries, 0 for padded requests, and seq_len >= query_len for real ones.",
    tag=Tag.SD,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="padded requests were given a context length, or the new tokens were not counted",
)
def pad_2(facts: BatchFacts, reader: ValueReader) -> Observed | None:
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
    "PAD-3",
    "block_table has num_reqs_padded rows, and every entry a kernel reads (the first ceil(seq_len / block_size) of a "
    "row: none of a padded request's, whose seq_len is 0) is a block id >= 0.",
    tag=Tag.SD,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="the block table was built for the real requests only (a padded request then reads a neighbour's "
    "row), or a row was filled with -1 where a kernel reads it",
    accepts="any filler in the columns past a row's context and in padded rows (block 0, stale ids): no kernel reads "
    "them while the padded request's seq_len is 0 (PAD-2)",
)
def pad_3(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    table_t, rows = facts.meta.block_table, facts.desc.num_reqs_padded(facts.num_reqs)
    if table_t.dim() != 2 or table_t.shape[0] != rows:
        return {"block_table shape": tuple(table_t.shape), "num_reqs_padded": rows}
    if facts.block_size is None:
        return None
    seq, _ = read_mirrored(reader, facts.meta.seq_lens, facts.meta.seq_lens_cpu)
    table = reader.device(table_t)
    if seq is None or table is None:
        return None
    read = {
        r: table[r][: -(-seq[r] // facts.block_size)]
        for r in range(min(len(seq), rows))
        if any(b < 0 for b in table[r][: -(-seq[r] // facts.block_size)])
    }
    if read:
        return {"(request, block ids a kernel reads)": sorted(read.items())[:8], "seq_lens": seq}
    return None
