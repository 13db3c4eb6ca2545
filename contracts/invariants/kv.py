"""KV-*: paged KV cache bookkeeping never loses or double-books a block, and padding never writes one."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from contracts.metadata import PAD_SLOT_ID
from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import BatchFacts, CacheFacts


@invariant(
    "KV-1",
    "Blocks in use plus free blocks equal the total, no block is held twice, and finished requests hold none.",
    tag=Tag.H,
    subject=Subject.CACHE,
    step_kinds={StepKind.CACHE},
    likely_cause="a finished or preempted request did not return its blocks, or a block was freed twice",
)
def kv_1(facts: CacheFacts, _: ValueReader) -> Observed | None:
    used = [b for table in facts.block_tables.values() for b in table]
    counts = Counter(used) + Counter(facts.free_blocks)
    duplicated = sorted(b for b, n in counts.items() if n > 1)
    out_of_range = sorted(b for b in counts if not 0 <= b < facts.num_blocks_total)
    holding = sorted(r for r in facts.finished_requests if facts.block_tables.get(r))
    if len(used) + len(facts.free_blocks) != facts.num_blocks_total or duplicated or out_of_range or holding:
        return {
            "in_use": len(used),
            "free": len(facts.free_blocks),
            "total": facts.num_blocks_total,
            "blocks held twice": duplicated,
            "blocks out of range": out_of_range,
            "finished requests still holding blocks": holding,
        }
    return None


@invariant(
    "KV-2",
    "After verification each cache holds exactly the committed length of every request; rejected positions are rolled back.",
    tag=Tag.H,
    subject=Subject.CACHE,
    step_kinds={StepKind.CACHE},
    likely_cause="KV written for rejected draft positions was not rolled back",
)
def kv_2(facts: CacheFacts, _: ValueReader) -> Observed | None:
    if facts.cache_lengths is None or facts.committed_lengths is None:
        return None
    wrong = {
        r: (facts.cache_lengths.get(r), n)
        for r, n in facts.committed_lengths.items()
        if facts.cache_lengths.get(r) != n
    }
    if facts.block_size is not None:
        short = {
            r: (len(facts.block_tables.get(r, ())), n)
            for r, n in facts.committed_lengths.items()
            if len(facts.block_tables.get(r, ())) * facts.block_size < n
        }
    else:
        short = {}
    if wrong or short:
        return {"(cached, committed) per request": wrong, "(blocks, committed) too few blocks": short}
    return None


@invariant(
    "KV-3",
    "Every forward, target or draft, has a slot_mapping of desc.num_tokens entries and writes no KV from a padded "
    "model row: entries past the real tokens are PAD_SLOT_ID (a block step's real rows: BLK-6).",
    tag=Tag.SD,
    subject=Subject.BATCH,
    step_kinds={StepKind.TARGET, StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK},
    likely_cause="a padded (CUDA graph or DP) row was given a live slot (repeating the last real slot, or the first "
    "request's), so its garbage K/V overwrites a real request's context; or the slot mapping was sized for the real "
    "tokens only",
)
def kv_3(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    mapping = facts.meta.slot_mapping
    if mapping.dim() != 1 or mapping.shape[0] != facts.desc.num_tokens:
        return {"slot_mapping shape": tuple(mapping.shape), "desc.num_tokens": facts.desc.num_tokens}
    slots = reader.device(mapping)
    if slots is None:
        return None
    live = [(row, s) for row, s in enumerate(slots) if row >= facts.num_tokens and s != PAD_SLOT_ID]
    if live:
        return {
            "real tokens": facts.num_tokens,
            "(padded row, slot) written": live[:8],
            "count": len(live),
            "slot_mapping": slots[:64],
        }
    return None


@invariant(
    "KV-4",
    "After a step only the requests the scheduler still runs hold blocks of a draft cache: finished and preempted requests hold none.",
    tag=Tag.H,
    subject=Subject.CACHE,
    step_kinds={StepKind.CACHE},
    likely_cause="the draft blocks of a finished or preempted request were not freed, or a drafter allocated "
    "draft blocks for a request that no longer runs",
)
def kv_4(facts: CacheFacts, _: ValueReader) -> Observed | None:
    if facts.live_requests is None:
        return None
    holding = sorted(r for r, table in facts.block_tables.items() if table and r not in facts.live_requests)
    if holding:
        return {
            "requests not running but holding blocks": {r: list(facts.block_tables[r]) for r in holding},
            "running": sorted(facts.live_requests),
        }
    return None
