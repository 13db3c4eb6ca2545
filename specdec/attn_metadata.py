"""Attention metadata for the target model's forward over a padded batch.

Everything is computed on the host as Python integers and then materialised
once on the target device, with host mirrors of ``query_start_loc`` and
``seq_lens`` kept for the [H] checks. Materialising straight from host values
(instead of copying a CPU tensor) also works for fake ``cuda`` tensors on a
CPU-only build, so the whole builder runs shape-only in CI.

Padding layout (``docs/concepts.md``): ``num_reqs_padded = desc.num_reqs or num_reqs`` request rows,
padded rows empty (``query_start_loc`` repeats the real token total,
``seq_lens`` 0, block-table rows of block 0); ``desc.num_tokens`` slot rows,
``PAD_SLOT_ID`` past the real tokens. The padding helpers below
(``padded_request_fields``, ``padded_slot_mapping`` and the list functions they
use) are the one implementation of that layout: the draft builders of the
shipped backends use them, and a backend author may too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch
from jaxtyping import Int
from torch import Tensor

from contracts import (
    PAD_SLOT_ID,
    AttentionMetadata,
    BatchExecutionDescriptor,
    BatchFacts,
    CUDAGraphMode,
    DescriptorFacts,
    Mode,
    StepKind,
    Subject,
    current_mode,
)
from contracts import check as run_checks
from specdec.kv_cache import KVCacheManager

COMPONENT = "target_attn_builder"


@dataclass(frozen=True)
class ScheduledRequest:
    """A request in this step: ``num_computed_tokens`` already cached, ``query_len`` new tokens.

    Prefill chunk: ``query_len > 1``; decode: 1; verify: K + 1.
    """

    req_id: str
    num_computed_tokens: int
    query_len: int

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0:
            raise ValueError(
                f"request {self.req_id!r}: num_computed_tokens must be >= 0, got {self.num_computed_tokens}"
            )
        if self.query_len < 1:
            raise ValueError(f"request {self.req_id!r}: a scheduled request needs query_len >= 1, got {self.query_len}")

    @property
    def seq_len(self) -> int:
        """Context the kernel attends over once this step's K/V is written."""
        return self.num_computed_tokens + self.query_len


def reserve(requests: Sequence[ScheduledRequest], kv: KVCacheManager) -> None:
    """Allocate the blocks this step's new tokens will be written to, for all requests or none.

    Kept out of the builder on purpose: allocation can fail (``OutOfBlocksError``)
    and the scheduler answers that by preempting, which must happen before any
    metadata exists. The builder only reads block tables.
    """
    kv.ensure_capacities({r.req_id: r.seq_len for r in requests})


def build_positions(
    requests: Sequence[ScheduledRequest],
    desc: BatchExecutionDescriptor,
    device: str | torch.device = "cpu",
) -> Int[Tensor, " num_tokens"]:
    """Token positions ``num_computed .. num_computed + query_len - 1`` per request; 0 for padded rows."""
    values = _positions(requests, desc.num_tokens)
    return torch.tensor(values, dtype=torch.int64, device=device)


def build_target_metadata(
    requests: Sequence[ScheduledRequest],
    desc: BatchExecutionDescriptor,
    kv: KVCacheManager,
    device: str | torch.device = "cpu",
    *,
    max_blocks: int | None = None,
    input_ids: Int[Tensor, " num_tokens"] | None = None,
    positions: Int[Tensor, " num_tokens"] | None = None,
) -> AttentionMetadata:
    """Build the target's attention metadata and check it (TGT-*) before returning it.

    The blocks must already exist (``reserve``). ``max_blocks`` fixes the block
    table width (e.g. a captured graph's buffer); by default it is the longest
    table. ``input_ids``/``positions`` are owned by the caller; pass them to have
    TGT-1 judge them here too, otherwise only the metadata is judged.

    Padded request rows and unused block-table columns hold block 0. That is safe
    although block 0 may belong to a live request: a kernel reads only the first
    ``ceil(seq_len / block_size)`` entries of a row, padded rows have
    ``seq_len`` 0 and every padded token writes to ``PAD_SLOT_ID``, so the
    filler entries are never read or written through.
    """
    num_reqs = len(requests)
    num_tokens = sum(r.query_len for r in requests)
    rows = desc.num_reqs_padded(num_reqs)
    _check_layout_fits(requests, desc, num_reqs, num_tokens, rows)

    tables = [kv.block_table(r.req_id) for r in requests]
    width = block_table_width(tables) if max_blocks is None else max_blocks
    too_wide = [(r.req_id, len(t)) for r, t in zip(requests, tables, strict=True) if len(t) > width]
    if too_wide:
        raise ValueError(f"max_blocks={width} is narrower than the block tables of {too_wide}")

    slot_mapping: list[int] = []
    for r in requests:
        slot_mapping.extend(kv.slot_mapping(r.req_id, range(r.num_computed_tokens, r.seq_len)))

    meta = AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        num_tokens_padded=desc.num_tokens if desc.cg_mode is CUDAGraphMode.FULL else num_tokens,
        max_query_len=max((r.query_len for r in requests), default=0),
        causal=True,
        slot_mapping=padded_slot_mapping(slot_mapping, desc.num_tokens, device),
        **padded_request_fields(
            [r.query_len for r in requests], [r.seq_len for r in requests], tables, rows, device, width=width
        ),
    )
    if current_mode() is not Mode.OFF:
        # The builder owns neither input_ids nor positions; shape-only stand-ins let TGT-1 pass on what it was not given.
        stand_in = torch.empty(desc.num_tokens, dtype=torch.int64, device="meta")
        check_target_batch(
            desc,
            requests,
            meta,
            input_ids if input_ids is not None else stand_in,
            positions if positions is not None else stand_in,
            kv.block_size,
        )
    return meta


class PaddedRequestFields(TypedDict):
    """The per-request fields of ``AttentionMetadata``, padded to ``num_reqs_padded`` request rows."""

    num_reqs_padded: int
    max_seq_len: int
    seq_lens: Int[Tensor, " num_reqs_padded"]
    query_start_loc: Int[Tensor, " num_reqs_padded_plus_1"]
    block_table: Int[Tensor, "num_reqs_padded width"]
    seq_lens_cpu: Int[Tensor, " num_reqs_padded"]
    query_start_loc_cpu: Int[Tensor, " num_reqs_padded_plus_1"]


def padded_request_fields(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    rows: int,
    device: str | torch.device,
    *,
    width: int | None = None,
) -> PaddedRequestFields:
    """The real requests' query lengths, context lengths and block tables, padded to ``rows`` and materialised.

    Unpacked into ``AttentionMetadata(...)``: device tensors plus the host mirrors the
    [H] checks read. ``width`` fixes the block-table width (default: the longest table).
    """
    qsl = padded_query_start_loc(query_lens, rows)
    seq = padded_seq_lens(seq_lens, rows)
    width = block_table_width(tables) if width is None else width
    table = padded_block_table(tables, rows, width)
    return PaddedRequestFields(
        num_reqs_padded=rows,
        max_seq_len=max(seq, default=0),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device).reshape(rows, width),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
    )


def padded_query_start_loc(query_lens: Sequence[int], rows: int) -> list[int]:
    """Each request's first query row, then the real total repeated: padded requests are zero-length."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return qsl + [qsl[-1]] * (rows - len(query_lens))


def padded_seq_lens(seq_lens: Sequence[int], rows: int) -> list[int]:
    """Context lengths of the real requests, 0 for padded ones (a kernel reads no block of theirs)."""
    return list(seq_lens) + [0] * (rows - len(seq_lens))


def block_table_width(tables: Sequence[Sequence[int]]) -> int:
    """The longest block table, at least one column so an empty batch still has a 2-D table."""
    return max([1, *(len(t) for t in tables)])


def padded_block_table(tables: Sequence[Sequence[int]], rows: int, width: int) -> list[list[int]]:
    """Tables filled with block 0 to ``width`` columns, then all-zero rows for padded requests.

    Block 0 is a safe filler although a live request may own it: a kernel reads
    only the first ``ceil(seq_len / block_size)`` entries of a row.
    """
    return [list(t) + [0] * (width - len(t)) for t in tables] + [[0] * width] * (rows - len(tables))


def padded_slot_mapping(
    slots: Sequence[int], num_tokens: int, device: str | torch.device
) -> Int[Tensor, " num_tokens"]:
    """The real tokens' KV slots, then ``PAD_SLOT_ID`` up to ``num_tokens`` model rows (their writes are dropped)."""
    return torch.tensor(list(slots) + [PAD_SLOT_ID] * (num_tokens - len(slots)), dtype=torch.int64, device=device)


def check_target_batch(
    desc: BatchExecutionDescriptor,
    requests: Sequence[ScheduledRequest],
    meta: AttentionMetadata,
    input_ids: Int[Tensor, " num_tokens"],
    positions: Int[Tensor, " num_tokens"],
    block_size: int | None,
    component: str = COMPONENT,
) -> None:
    """The boundary check of a target forward: every TGT invariant for the current enforcement mode."""
    if current_mode() is Mode.OFF:
        return
    facts = BatchFacts(
        desc=desc,
        num_reqs=len(requests),
        num_tokens=sum(r.query_len for r in requests),
        meta=meta,
        input_ids=input_ids,
        positions=positions,
        block_size=block_size,
    )
    run_checks(Subject.BATCH, facts, step_kind=StepKind.TARGET, component=component)


def _positions(requests: Sequence[ScheduledRequest], num_tokens_padded: int) -> list[int]:
    values: list[int] = []
    for r in requests:
        values.extend(range(r.num_computed_tokens, r.seq_len))
    if len(values) > num_tokens_padded:
        raise ValueError(f"{len(values)} real tokens do not fit in desc.num_tokens={num_tokens_padded}")
    values.extend([0] * (num_tokens_padded - len(values)))
    return values


def _check_layout_fits(
    requests: Sequence[ScheduledRequest],
    desc: BatchExecutionDescriptor,
    num_reqs: int,
    num_tokens: int,
    rows: int,
) -> None:
    """Reject a batch the descriptor cannot hold, naming the DESC invariant when contracts are on."""
    if current_mode() is not Mode.OFF:
        run_checks(
            Subject.DESCRIPTOR,
            DescriptorFacts(desc=desc, num_reqs=num_reqs, num_tokens=num_tokens),
            step_kind=StepKind.TARGET,
            component=COMPONENT,
        )
    if rows < num_reqs or desc.num_tokens < num_tokens:
        raise ValueError(
            f"{desc!r} cannot hold {num_reqs} requests with {num_tokens} tokens "
            f"(num_reqs_padded={rows}, desc.num_tokens={desc.num_tokens})"
        )
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a request is scheduled twice in one batch: {ids}")
