"""IN-*: model inputs and attention metadata have index dtypes, one device, and non-negative positions.

These hold for every forward of a step, target or draft, so a drafter's
metadata is held to the target's standard. IN-1 and IN-2 read only tensor
attributes (dtype, device), never values, so ``shapes`` checks them for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant

if TYPE_CHECKING:
    from contracts.facts import BatchFacts

FORWARDS = {StepKind.TARGET, StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK}
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _device_tensors(facts: BatchFacts) -> dict[str, Any]:
    """The tensors a kernel reads on the model's device, by name."""
    meta = facts.meta
    named = {
        "input_ids": facts.input_ids,
        "positions": facts.positions,
        "seq_lens": meta.seq_lens,
        "query_start_loc": meta.query_start_loc,
        "block_table": meta.block_table,
        "slot_mapping": meta.slot_mapping,
    }
    return {name: t for name, t in named.items() if t is not None}


def _host_mirrors(facts: BatchFacts) -> dict[str, Any]:
    named = {"query_start_loc_cpu": facts.meta.query_start_loc_cpu, "seq_lens_cpu": facts.meta.seq_lens_cpu}
    return {name: t for name, t in named.items() if t is not None}


@invariant(
    "IN-1",
    "input_ids, positions and every index tensor of the attention metadata (seq_lens, query_start_loc, block_table, "
    "slot_mapping and their host mirrors) have an integer dtype.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="ids or positions were built with a float factory (torch.zeros without dtype, arange on a float), "
    "so embedding lookups and KV addressing get truncated or rejected values",
)
def in_1(facts: BatchFacts, _: ValueReader) -> Observed | None:
    tensors = {**_device_tensors(facts), **_host_mirrors(facts)}
    wrong = {name: str(t.dtype) for name, t in tensors.items() if t.dtype not in _INDEX_DTYPES}
    if wrong:
        return {"non-integer tensors (name: dtype)": wrong}
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@invariant(
    "IN-2",
    "input_ids, positions and the attention metadata tensors live on one device (a meta input_ids or positions is a "
    "shape-only stand-in and names no device); the host mirrors (*_cpu) live on the host.",
    tag=Tag.S,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="a metadata tensor was built on the host (or left on the meta device) instead of the model's device, "
    "or a host mirror was moved to the device (each read of it would then be a hidden sync); fix: build every "
    "metadata tensor with device=input_ids.device (the target step's device) and keep only the *_cpu mirrors on "
    "the host",
    accepts="meta stand-ins for input_ids and positions where a metadata builder checks metadata it was given "
    "without the model inputs",
)
def in_2(facts: BatchFacts, _: ValueReader) -> Observed | None:
    stand_ins = {"input_ids", "positions"} if facts.input_ids.is_meta else set()
    tensors = {n: t for n, t in _device_tensors(facts).items() if n not in stand_ins or not t.is_meta}
    home = next(iter(tensors.values())).device if tensors else None
    elsewhere = {n: str(t.device) for n, t in tensors.items() if home is not None and not _same_device(t.device, home)}
    mirrors = {n: str(t.device) for n, t in _host_mirrors(facts).items() if t.device.type != "cpu"}
    if elsewhere or mirrors:
        return {
            "model device": str(home),
            "tensors on another device": elsewhere,
            "host mirrors not on the host": mirrors,
        }
    return None


@invariant(
    "IN-3",
    "Positions are non-negative (padded rows included).",
    tag=Tag.D,
    subject=Subject.BATCH,
    step_kinds=FORWARDS,
    likely_cause="a padded row was given position -1, or a position was computed from a length before the "
    "request's first token; rotary embeddings and KV addressing would read outside the sequence",
)
def in_3(facts: BatchFacts, reader: ValueReader) -> Observed | None:
    pos = reader.device(facts.positions)
    if pos is None:
        return None
    flat = [p for row in pos for p in row] if pos and isinstance(pos[0], list) else pos
    negative = [i for i, p in enumerate(flat) if p < 0]
    if negative:
        return {"rows with a negative position": negative[:20], "count": len(negative), "positions": flat[:64]}
    return None
