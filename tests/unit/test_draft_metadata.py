"""Draft attention metadata (AR decode, block step) from the shared padding helpers, and the fused decode's advance.

The expected values are written out independently of ``specdec.attn_metadata``'s
helpers: each builder must produce exactly the padded layout its contracts
(AR-5..AR-8, BLK-3..BLK-6) describe, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import PAD_SLOT_ID, AttentionMetadata, BatchExecutionDescriptor, CUDAGraphMode
from specdec.attn_metadata import padded_block_table, padded_query_start_loc, padded_slot_mapping
from specdec.draft_builders import advance_decode_metadata, build_block_metadata, build_decode_metadata
from specdec.kv_cache import KVCacheManager

BLOCK_SIZE, MAX_LEN = 4, 64
CPU = torch.device("cpu")


def _kv(lengths: list[int]) -> tuple[KVCacheManager, list[str]]:
    kv = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE)
    ids = [f"r{i}" for i in range(len(lengths))]
    for rid, n in zip(ids, lengths, strict=True):
        kv.add_request(rid)
        kv.ensure_capacity(rid, n)
    return kv, ids


def _desc(num_reqs: int, q: int, full_rows: int | None, dp_pad: int) -> BatchExecutionDescriptor:
    if full_rows is not None:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL, num_tokens=full_rows * q, num_reqs=full_rows, uniform_token_count=q
        )
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=num_reqs * q + dp_pad, num_reqs=num_reqs, uniform_token_count=q
    )


def _expected_tables(kv: KVCacheManager, ids: list[str], rows: int) -> list[list[int]]:
    tables = [kv.block_table(r) for r in ids]
    width = max([1, *(len(t) for t in tables)])
    return [t + [0] * (width - len(t)) for t in tables] + [[0] * width for _ in range(rows - len(ids))]


def _assert_request_rows(meta: AttentionMetadata, qsl: list[int], seq: list[int], table: list[list[int]]) -> None:
    for name, want, dtype in (
        ("query_start_loc", qsl, torch.int32),
        ("query_start_loc_cpu", qsl, torch.int32),
        ("seq_lens", seq, torch.int32),
        ("seq_lens_cpu", seq, torch.int32),
    ):
        got = getattr(meta, name)
        assert got.dtype == dtype and got.tolist() == want, name
    assert meta.block_table.dtype == torch.int32 and meta.block_table.tolist() == table
    assert meta.max_seq_len == max(seq, default=0)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], int, int | None, int]:
    """Cached lengths of the real requests, q, FULL rows (None: eager) and an eager DP pad of model rows."""
    lengths = draw(st.lists(st.integers(1, 40), max_size=6))
    q = draw(st.integers(1, 5))
    full = draw(st.one_of(st.none(), st.integers(max(len(lengths), 1), 8)))
    return lengths, q, full, draw(st.integers(0, 3)) if full is None else 0


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_decode_metadata_is_the_padded_one_query_layout(layout: tuple[list[int], int, int | None, int]) -> None:
    lengths, _, full, pad = layout
    kv, ids = _kv([n + 1 for n in lengths])
    n = len(ids)
    desc = _desc(n, 1, full, pad)
    rows = desc.num_reqs_padded(n)
    meta = build_decode_metadata(desc, ids, lengths, kv, MAX_LEN, CPU)
    seq = [min(p + 1, MAX_LEN) for p in lengths] + [0] * (rows - n)
    _assert_request_rows(meta, [min(i, n) for i in range(rows + 1)], seq, _expected_tables(kv, ids, rows))
    slots = [kv.slot_mapping(r, [p])[0] for r, p in zip(ids, lengths, strict=True)]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == slots + [PAD_SLOT_ID] * (desc.num_tokens - n)
    assert (meta.num_reqs, meta.num_reqs_padded, meta.num_tokens, meta.max_query_len) == (n, rows, n, 1)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_block_metadata_is_the_padded_block_layout(layout: tuple[list[int], int, int | None, int]) -> None:
    lengths, q, full, pad = layout
    kv, ids = _kv([n + q for n in lengths])
    n = len(ids)
    desc = _desc(n, q, full, pad)
    rows = desc.num_reqs_padded(n)
    meta = build_block_metadata(desc, ids, lengths, q, kv, MAX_LEN, CPU)
    seq = [min(p + 1 + q, MAX_LEN) for p in lengths] + [0] * (rows - n)
    _assert_request_rows(meta, [min(r, n) * q for r in range(rows + 1)], seq, _expected_tables(kv, ids, rows))
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [PAD_SLOT_ID] * desc.num_tokens
    assert (meta.num_reqs_padded, meta.num_tokens, meta.max_query_len, meta.query_width) == (rows, n * q, q, q)


def test_padding_helpers_on_a_concrete_batch() -> None:
    assert padded_query_start_loc([3, 1, 2], 5) == [0, 3, 4, 6, 6, 6]
    assert padded_query_start_loc([], 2) == [0, 0, 0]
    assert padded_block_table([[4, 5], [7]], 3, 3) == [[4, 5, 0], [7, 0, 0], [0, 0, 0]]
    assert padded_slot_mapping([9, 10], 4, "cpu").tolist() == [9, 10, PAD_SLOT_ID, PAD_SLOT_ID]


def test_fused_advance_keeps_the_metadata_frozen_and_the_buffers_shared() -> None:
    kv, ids = _kv([12, 30, 7])
    desc = _desc(3, 1, None, 2)
    first = build_decode_metadata(desc, ids, [9, 20, 5], kv, MAX_LEN, CPU)
    buffers = (first.seq_lens, first.slot_mapping, first.seq_lens_cpu, first.block_table, first.query_start_loc)
    was = first.max_seq_len
    nxt = advance_decode_metadata(first, ids, [10, 21, 6], kv, MAX_LEN)
    assert nxt is not first and first.max_seq_len == was  # the old object is not mutated
    with pytest.raises(dataclasses.FrozenInstanceError):
        nxt.max_seq_len = 0  # type: ignore[misc]
    after = (nxt.seq_lens, nxt.slot_mapping, nxt.seq_lens_cpu, nxt.block_table, nxt.query_start_loc)
    assert all(a is b for a, b in zip(after, buffers, strict=True))  # updated in place: the fused path's buffers
    rebuilt = build_decode_metadata(desc, ids, [10, 21, 6], kv, MAX_LEN, CPU)
    for name in ("seq_lens", "seq_lens_cpu", "slot_mapping", "query_start_loc", "block_table"):
        assert torch.equal(getattr(nxt, name), getattr(rebuilt, name)), name
    assert nxt.max_seq_len == rebuilt.max_seq_len == 22
    # Stepping back (clamped positions) keeps max_seq_len an upper bound.
    back = advance_decode_metadata(nxt, ids, [1, 2, 3], kv, MAX_LEN)
    assert back.max_seq_len == 22 and back.seq_lens.tolist()[:3] == [2, 3, 4]
