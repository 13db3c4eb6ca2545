"""Context writes held back while no request drafts, then written in one batch before the cache is read.

A drafter keeps its cache in step with the target: each step it writes every
committed row's context into the draft cache (DFlash and DSpark their fused
target features' K/V, EAGLE its layer's K/V). When the draft-length policy
drafts nothing, nobody reads that cache until the next step that drafts, yet
each write is a few one-row matmuls over weights that the target's forward has
pushed out of the caches: 1-1.5 ms of a 20-30 ms batch-1 step on the benchmark
CPU, the whole of what an idle drafter cost there. Held back, the writes of many
steps go out as one matmul over all their rows.

Writing later, in the order planned, leaves every slot as writing at once
would, because a slot's last write wins either way: the rows of a request that
finished or was preempted meanwhile can only reach blocks whose next owner
writes after them. Inside one batched write a slot planned twice keeps its
latest row (an indexed copy with repeated indices keeps an arbitrary one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Int, Shaped
from torch import Tensor

from contracts import PAD_SLOT_ID

if TYPE_CHECKING:
    from specdec.kv_cache import KVCacheManager
    from specdec.speculator import TargetStep

MAX_HELD_ROWS = 256
"""Rows held before they are written anyway: bounds the memory (a few KB per row) and the write's size."""


@dataclass(frozen=True, eq=False)
class ContextRows:
    """Committed rows to write into a draft cache: per-row inputs, positions and the host slots they go to."""

    features: tuple[Shaped[Tensor, "rows ..."], ...]
    """The drafter's per-row inputs (target hidden states of the fused layers; EAGLE adds its input ids)."""
    positions: Int[Tensor, " rows"]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.slots)
        if self.positions.shape[0] != n or any(f.shape[0] != n for f in self.features):
            raise ValueError(
                f"context rows disagree on their count: {n} slots, {self.positions.shape[0]} positions, "
                f"features with {[f.shape[0] for f in self.features]} rows"
            )

    def slot_mapping(self) -> Int[Tensor, " rows"]:
        return torch.tensor(self.slots, dtype=torch.int64, device=self.positions.device)

    def select(self, rows: Sequence[int]) -> ContextRows:
        """These rows, in this order (``self`` when that is all of them in order)."""
        if list(rows) == list(range(len(self.slots))):
            return self
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.positions.device)
        return ContextRows(
            tuple(f.index_select(0, index) for f in self.features),
            self.positions.index_select(0, index),
            tuple(self.slots[i] for i in rows),
        )


class ContextBacklog:
    """Context rows held in the order their steps planned them, copied into buffers of ``max_rows`` rows.

    The rows are copied, never kept by reference: the features are the target
    forward's own layer outputs, and holding dozens of them alive slowed that
    forward by ~20% at batch 8 on the benchmark CPU (its temporaries no longer
    reused the allocator's freed memory). The buffers are allocated once, at
    the first hold.
    """

    def __init__(self, max_rows: int = MAX_HELD_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self._features: tuple[Tensor, ...] = ()
        self._positions: Tensor | None = None
        self._slots: list[int] = []

    @property
    def rows(self) -> int:
        return len(self._slots)

    def hold(self, rows: ContextRows) -> ContextRows | None:
        """Hold ``rows``; returns what must be written now instead: everything held and ``rows`` when they do not
        fit, everything when the backlog is full (else None)."""
        n = len(rows.slots)
        if not n:
            return None
        if self.rows + n > self.max_rows:
            return self.take(then=rows)
        self._allocate(rows)
        assert self._positions is not None
        start = self.rows
        for buffer, f in zip(self._features, rows.features, strict=True):
            buffer[start : start + n] = f
        self._positions[start : start + n] = rows.positions
        self._slots.extend(rows.slots)
        return self.take() if self.rows == self.max_rows else None

    def _allocate(self, rows: ContextRows) -> None:
        shapes = [(f.shape[1:], f.dtype, f.device) for f in rows.features]
        if self._positions is None:
            self._features = tuple(
                torch.empty((self.max_rows, *shape), dtype=d, device=dev) for shape, d, dev in shapes
            )
            self._positions = torch.empty(self.max_rows, dtype=rows.positions.dtype, device=rows.positions.device)
        elif shapes != [(b.shape[1:], b.dtype, b.device) for b in self._features]:
            raise ValueError(
                f"context rows with features {[tuple(f.shape[1:]) for f in rows.features]} after "
                f"{[tuple(b.shape[1:]) for b in self._features]}: a drafter's held rows keep one layout"
            )

    def clear(self) -> None:
        self._slots = []

    def take(self, then: ContextRows | None = None) -> ContextRows | None:
        """Everything held, then ``then``, as one write (the latest row of each slot); the backlog is emptied.

        Held rows come back as views of the backlog's buffers: write them before the next ``hold``.
        """
        n = self.rows
        held = None
        if n:
            assert self._positions is not None
            held = ContextRows(tuple(b[:n] for b in self._features), self._positions[:n], tuple(self._slots))
        self.clear()
        parts = [p for p in (held, then) if p is not None and p.slots]
        if not parts:
            return None
        if len(parts) == 1:
            merged = parts[0]
        else:
            merged = ContextRows(
                features=tuple(torch.cat(fs) for fs in zip(*(p.features for p in parts), strict=True)),
                positions=torch.cat([p.positions for p in parts]),
                slots=tuple(s for p in parts for s in p.slots),
            )
        return latest_per_slot(merged)


def latest_per_slot(rows: ContextRows) -> ContextRows:
    """``rows`` without the earlier rows of any slot that a later row writes again."""
    last = {slot: i for i, slot in enumerate(rows.slots)}
    return rows.select(sorted(last.values()))


def committed_slots(step: TargetStep, cache: KVCacheManager) -> list[int]:
    """Each model row's draft slot where its position was committed; ``PAD_SLOT_ID`` for rejected drafts and the
    rows of finished and padded requests (from the scheduler's committed lengths)."""
    slots = [PAD_SLOT_ID] * step.desc.num_tokens
    row = 0
    for s in step.scheduled:
        end = step.committed_lengths.get(s.req_id, 0)
        keep = [p for p in range(s.num_computed_tokens, s.seq_len) if p < end]
        slots[row : row + len(keep)] = cache.slot_mapping(s.req_id, keep)
        row += s.query_len
    return slots


def rows_with_slots(features: Sequence[Tensor], positions: Int[Tensor, " rows"], slots: Sequence[int]) -> ContextRows:
    """The model rows whose slot is not ``PAD_SLOT_ID``: the ones a context write keeps."""
    every = ContextRows(tuple(features), positions, tuple(slots))
    return every.select([i for i, slot in enumerate(slots) if slot != PAD_SLOT_ID])


__all__ = ["MAX_HELD_ROWS", "ContextBacklog", "ContextRows", "committed_slots", "latest_per_slot", "rows_with_slots"]
