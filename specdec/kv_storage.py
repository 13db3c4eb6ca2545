"""The paged KV cache tensors: flat slots per layer, written through a slot mapping.

Each layer's buffer has two extra rows past the last real slot. Writes
redirect ``PAD_SLOT_ID`` rows to the first (scratch) with a mask, so dropping
padded rows needs no data-dependent shapes: it works unchanged on meta and fake
tensors and inside a captured CUDA graph, and never reads a device value. The
second (null) row is never written and stays zero: batched attention pads every
request's context to a common width, and the padding positions read it, so they
can never carry a NaN or an infinity into a masked-out score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from contracts import PAD_SLOT_ID


class PagedKVStorage:
    """Key and value caches of every layer, ``[num_blocks * block_size, num_kv_heads, head_dim]`` each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not dtype.is_floating_point:
            raise ValueError(f"KV cache dtype must be floating point, got {dtype}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_slots = num_blocks * block_size
        self.null_slot = self.num_slots + 1
        shape = (self.num_slots + 2, num_kv_heads, head_dim)  # + the scratch row and the null row
        self._key_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._value_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self._key_buffers[0].device

    def key_cache(self, layer: int) -> Float[Tensor, "num_slots kv_heads head_dim"]:
        """A view of the layer's key slots (the scratch row excluded)."""
        return self._key_buffers[self._layer(layer)][: self.num_slots]

    def value_cache(self, layer: int) -> Float[Tensor, "num_slots kv_heads head_dim"]:
        return self._value_buffers[self._layer(layer)][: self.num_slots]

    def write(
        self,
        layer: int,
        slot_mapping: Int[Tensor, " num_tokens"],
        key: Float[Tensor, "num_tokens kv_heads head_dim"],
        value: Float[Tensor, "num_tokens kv_heads head_dim"],
        *,
        buffer_rows: Int[Tensor, " num_tokens"] | None = None,
    ) -> None:
        """Store each row's K/V at its slot; rows whose slot is ``PAD_SLOT_ID`` are dropped.

        ``buffer_rows`` is ``write_rows(slot_mapping)`` when the caller already
        has it (a forward computes it once for all its layers).
        """
        index = self._layer(layer)
        self._validate_write(slot_mapping, key, value)
        if buffer_rows is None:
            buffer_rows = self.write_rows(slot_mapping)
        elif buffer_rows.shape != slot_mapping.shape:
            raise ValueError(
                f"buffer_rows has shape {tuple(buffer_rows.shape)}; the slot mapping has {tuple(slot_mapping.shape)}"
            )
        self._key_buffers[index].index_copy_(0, buffer_rows, key)
        self._value_buffers[index].index_copy_(0, buffer_rows, value)

    def write_rows(self, slot_mapping: Int[Tensor, " num_tokens"]) -> Int[Tensor, " num_tokens"]:
        """The buffer row each slot-mapping entry writes to: its slot, or the scratch row for ``PAD_SLOT_ID``."""
        slots = slot_mapping.to(torch.int64)
        # Every PAD row lands on the scratch row; which of them wins there does not matter.
        return torch.where(slots == PAD_SLOT_ID, self.num_slots, slots)

    def gather(
        self,
        layer: int,
        block_table_row: Int[Tensor, " max_blocks"],
        seq_len: int,
    ) -> tuple[Float[Tensor, "seq_len kv_heads head_dim"], Float[Tensor, "seq_len kv_heads head_dim"]]:
        """The first ``seq_len`` cached positions of one request, in position order."""
        index = self._layer(layer)
        if block_table_row.dim() != 1 or block_table_row.dtype.is_floating_point:
            raise ValueError(
                f"block_table_row must be a 1-D integer tensor, got {block_table_row.dtype} {tuple(block_table_row.shape)}"
            )
        capacity = block_table_row.shape[0] * self.block_size
        if not 0 <= seq_len <= capacity:
            raise ValueError(
                f"seq_len {seq_len} is outside [0, {capacity}] for a block table row of "
                f"{block_table_row.shape[0]} blocks of {self.block_size}"
            )
        self._require_device(block_table_row, "block_table_row")
        positions = torch.arange(seq_len, device=self.device)
        blocks = block_table_row.to(torch.int64).index_select(0, positions // self.block_size)
        slots = blocks * self.block_size + positions % self.block_size
        return (
            self._key_buffers[index].index_select(0, slots),
            self._value_buffers[index].index_select(0, slots),
        )

    def slot_table(
        self, block_table: Int[Tensor, "reqs max_blocks"], seq_lens: Sequence[int], width: int
    ) -> Int[Tensor, "reqs width"]:
        """The cache slot of positions ``0 .. width-1`` of each request; positions past its length get the null slot.

        One table serves every layer of a forward (the slots are the same in each), so
        batched attention gathers all requests' contexts with a single ``index_select``.
        """
        if block_table.dim() != 2 or block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
            raise ValueError(
                f"block_table must be a 2-D integer tensor, got {block_table.dtype} {tuple(block_table.shape)}"
            )
        if len(seq_lens) != block_table.shape[0]:
            raise ValueError(f"{len(seq_lens)} seq_lens for a block table of {block_table.shape[0]} rows")
        capacity = block_table.shape[1] * self.block_size
        for seq_len in seq_lens:
            if not 0 <= seq_len <= capacity:
                raise ValueError(
                    f"seq_len {seq_len} is outside [0, {capacity}] for a block table row of "
                    f"{block_table.shape[1]} blocks of {self.block_size}"
                )
        if not max(seq_lens, default=0) <= width <= capacity:
            raise ValueError(f"width {width} must cover the longest seq_len and fit the block table ({capacity})")
        self._require_device(block_table, "block_table")
        positions = torch.arange(width, device=self.device)
        blocks = block_table.to(torch.int64).index_select(1, positions // self.block_size)
        slots = blocks * self.block_size + positions % self.block_size
        lens = torch.tensor(list(seq_lens), dtype=torch.int64, device=self.device)
        return torch.where(positions[None, :] < lens[:, None], slots, self.null_slot)

    def gather_slots(
        self, layer: int, slots: Int[Tensor, "*shape"]
    ) -> tuple[Float[Tensor, "*shape kv_heads head_dim"], Float[Tensor, "*shape kv_heads head_dim"]]:
        """K and V at ``slots`` (from ``slot_table``), shaped like ``slots`` plus ``[kv_heads, head_dim]``."""
        index = self._layer(layer)
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.num_kv_heads, self.head_dim)
        return (
            self._key_buffers[index].index_select(0, flat).view(shape),
            self._value_buffers[index].index_select(0, flat).view(shape),
        )

    def slot_range(
        self, layer: int, start: int, length: int
    ) -> tuple[Float[Tensor, "length kv_heads head_dim"], Float[Tensor, "length kv_heads head_dim"]]:
        """Views (no copy) of K and V at slots ``start .. start+length-1``: a context whose blocks are consecutive."""
        index = self._layer(layer)
        if start < 0 or length < 0 or start + length > self.num_slots:
            raise ValueError(f"slots [{start}, {start + length}) are outside the cache's [0, {self.num_slots})")
        return self._key_buffers[index][start : start + length], self._value_buffers[index][start : start + length]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.num_layers})")
        return layer

    def _validate_write(self, slot_mapping: Tensor, key: Tensor, value: Tensor) -> None:
        """Shape, dtype and device checks a fused cache-write kernel would make; reads no values."""
        if slot_mapping.dim() != 1 or slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
            raise ValueError(
                f"slot_mapping must be a 1-D integer tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            )
        expected = (self.num_kv_heads, self.head_dim)
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 3 or tuple(t.shape[1:]) != expected:
                raise ValueError(
                    f"{name} must have shape [num_tokens, {expected[0]}, {expected[1]}], got {tuple(t.shape)}"
                )
            if t.shape[0] != slot_mapping.shape[0]:
                raise ValueError(
                    f"slot_mapping has {slot_mapping.shape[0]} entries but {name} has {t.shape[0]} rows; "
                    "every row (padded ones included) needs a slot"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name} dtype {t.dtype} does not match the cache dtype {self.dtype}")
            self._require_device(t, name)
        self._require_device(slot_mapping, "slot_mapping")

    def _require_device(self, t: Tensor, name: str) -> None:
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device} but the KV cache is on {self.device}")
