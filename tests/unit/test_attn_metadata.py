"""Target attention metadata: generated batches satisfy every TGT invariant, and each invariant catches its bug."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from contracts import (
    PAD_SLOT_ID,
    AttentionMetadata,
    BatchExecutionDescriptor,
    ContractViolation,
    CUDAGraphMode,
    StepKind,
    Subject,
    check,
    enforce,
)
from contracts.registry import ValueReader
from specdec.attn_metadata import (
    ScheduledRequest,
    build_positions,
    build_target_metadata,
    check_target_batch,
    reserve,
)
from specdec.kv_cache import KVCacheError, KVCacheManager, OutOfBlocksError, blocks_for

# -- generated batches -----------------------------------------------------------------------------


@dataclass
class TargetBatch:
    requests: list[ScheduledRequest]
    desc: BatchExecutionDescriptor
    kv: KVCacheManager

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.requests)


@st.composite
def descriptors(draw: st.DrawFn, query_lens: list[int], kind: str) -> BatchExecutionDescriptor:
    """A valid descriptor of the given padding kind for a batch with these query lengths."""
    num_reqs, real = len(query_lens), sum(query_lens)
    token_pad = draw(st.integers(0, 8), label="token padding (CG bucket + DP)")
    if kind == "NONE":
        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=real, num_reqs=num_reqs)
    if kind == "PIECEWISE":
        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=real + token_pad)
    padded_reqs = num_reqs + draw(st.integers(0, 4), label="request padding")
    if kind == "FULL_UNIFORM":
        u = query_lens[0] if query_lens else draw(st.integers(1, 4))
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.FULL, num_tokens=padded_reqs * u, num_reqs=padded_reqs, uniform_token_count=u
        )
    # FULL over a mixed batch: requests and tokens padded independently
    num_tokens = max(real + token_pad, 1 if padded_reqs else 0)
    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=num_tokens, num_reqs=padded_reqs)


@st.composite
def target_batches(draw: st.DrawFn) -> TargetBatch:
    """Mixed prefill/decode batches, a valid descriptor, and a fragmented cache that holds their context."""
    kind = draw(st.sampled_from(["NONE", "PIECEWISE", "FULL_UNIFORM", "FULL_MIXED"]))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_reqs = draw(st.integers(0, 6))
    if kind == "FULL_UNIFORM":
        u = draw(st.integers(1, 5), label="uniform query length (decode 1, verify K+1)")
        query_lens = [u] * num_reqs
    else:
        decode_or_prefill = st.one_of(st.just(1), st.integers(2, 12))
        query_lens = draw(st.lists(decode_or_prefill, min_size=num_reqs, max_size=num_reqs))
    computed = draw(st.lists(st.integers(0, 30), min_size=num_reqs, max_size=num_reqs))
    requests = [ScheduledRequest(f"req{i}", c, q) for i, (c, q) in enumerate(zip(computed, query_lens, strict=True))]
    desc = draw(descriptors(query_lens, kind))

    spare = draw(st.integers(0, 3))
    kv = KVCacheManager(
        num_blocks=sum(blocks_for(r.seq_len, block_size) for r in requests) + spare, block_size=block_size
    )
    for r in requests:
        kv.add_request(r.req_id)
    # the cached context grows one block at a time in a drawn interleaving, so tables are fragmented
    events = [r for r in requests for _ in range(blocks_for(r.num_computed_tokens, block_size))]
    for r in draw(st.permutations(events)):
        kv.ensure_capacity(r.req_id, kv.capacity(r.req_id) + 1)
    for r in requests:
        kv.set_length(r.req_id, r.num_computed_tokens)
    reserve(requests, kv)
    return TargetBatch(requests, desc, kv)


def model_inputs(batch: TargetBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch.desc.num_tokens, dtype=torch.int64)
    return ids, build_positions(batch.requests, batch.desc)


@settings(max_examples=120, deadline=None)
@given(batch=target_batches())
def test_generated_batches_satisfy_every_target_invariant(batch: TargetBatch) -> None:
    requests, desc, kv = batch.requests, batch.desc, batch.kv
    num_reqs, real = len(requests), batch.num_tokens
    rows = desc.num_reqs_padded(num_reqs)
    with enforce("full"):
        meta = build_target_metadata(requests, desc, kv)  # checks itself
        ids, positions = model_inputs(batch)
        check_target_batch(desc, requests, meta, ids, positions, kv.block_size)

    # counts
    attention_rows = desc.num_tokens if desc.cg_mode is CUDAGraphMode.FULL else real
    assert (meta.num_reqs, meta.num_reqs_padded, meta.num_tokens, meta.num_tokens_padded) == (
        num_reqs,
        rows,
        real,
        attention_rows,
    )
    assert meta.max_query_len == max((r.query_len for r in requests), default=0)
    assert meta.max_seq_len == max((r.seq_len for r in requests), default=0)
    assert meta.causal is True

    # query_start_loc: prefix sums, padded requests empty
    expected_qsl = [0]
    for r in requests:
        expected_qsl.append(expected_qsl[-1] + r.query_len)
    expected_qsl += [real] * (rows - num_reqs)
    assert meta.query_start_loc.tolist() == expected_qsl
    assert meta.query_start_loc_cpu is not None and meta.query_start_loc_cpu.tolist() == expected_qsl

    # seq_lens: context + new tokens, 0 for padded rows
    expected_seq = [r.seq_len for r in requests] + [0] * (rows - num_reqs)
    assert meta.seq_lens.tolist() == expected_seq
    assert meta.seq_lens_cpu is not None and meta.seq_lens_cpu.tolist() == expected_seq

    # block_table: each request's blocks, then zeros
    table = meta.block_table.tolist()
    assert len(table) == rows
    for i, r in enumerate(requests):
        blocks = kv.block_table(r.req_id)
        assert table[i][: len(blocks)] == blocks and not any(table[i][len(blocks) :])
    assert all(not any(row) for row in table[num_reqs:])

    # slot_mapping and positions, token by token
    slots, pos = meta.slot_mapping.tolist(), positions.tolist()
    assert len(slots) == len(pos) == desc.num_tokens
    t = 0
    for r in requests:
        blocks = kv.block_table(r.req_id)
        for p in range(r.num_computed_tokens, r.seq_len):
            assert pos[t] == p
            assert slots[t] == blocks[p // kv.block_size] * kv.block_size + p % kv.block_size
            t += 1
    assert slots[t:] == [PAD_SLOT_ID] * (desc.num_tokens - real)
    assert pos[t:] == [0] * (desc.num_tokens - real)


# -- one concrete batch to corrupt -----------------------------------------------------------------

BLOCK_SIZE = 4


def verify_batch() -> TargetBatch:
    """Three real requests verifying K=2 drafts under FULL, padded to 4 requests and 12 tokens."""
    requests = [ScheduledRequest("a", 5, 3), ScheduledRequest("b", 0, 3), ScheduledRequest("c", 9, 3)]
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=12, num_reqs=4, uniform_token_count=3)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    for r in requests:
        kv.add_request(r.req_id)
        kv.ensure_capacity(r.req_id, r.num_computed_tokens)
        kv.set_length(r.req_id, r.num_computed_tokens)
    reserve(requests, kv)
    return TargetBatch(requests, desc, kv)


def corrupt(meta: AttentionMetadata, **changes: Any) -> AttentionMetadata:
    """A copy with fields replaced, bypassing the jaxtyping check the test hook adds to the dataclass:
    production runs without that hook, so each contract must catch the bug on its own."""
    bad = copy.copy(meta)
    for name, value in changes.items():
        object.__setattr__(bad, name, value)
    return bad


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def violated(batch: TargetBatch, meta: AttentionMetadata, mode: str = "full", inputs: Any = None) -> str:
    ids, positions = inputs if inputs is not None else model_inputs(batch)
    with enforce(mode), pytest.raises(ContractViolation) as err:
        check_target_batch(batch.desc, batch.requests, meta, ids, positions, batch.kv.block_size)
    assert err.value.component == "target_attn_builder"
    return err.value.invariant_id


@pytest.fixture
def batch() -> TargetBatch:
    return verify_batch()


@pytest.fixture
def meta(batch: TargetBatch) -> AttentionMetadata:
    with enforce("full"):
        return build_target_metadata(batch.requests, batch.desc, batch.kv)


def test_concrete_verify_batch_layout(batch: TargetBatch, meta: AttentionMetadata) -> None:
    assert meta.query_start_loc.tolist() == [0, 3, 6, 9, 9]
    assert meta.seq_lens.tolist() == [8, 3, 12, 0]
    assert meta.block_table.tolist() == [[0, 1, 0], [5, 0, 0], [2, 3, 4], [0, 0, 0]]
    assert meta.slot_mapping.tolist() == [5, 6, 7, 20, 21, 22, 17, 18, 19, -1, -1, -1]
    assert build_positions(batch.requests, batch.desc).tolist() == [5, 6, 7, 0, 1, 2, 9, 10, 11, 0, 0, 0]


def test_tgt1_model_inputs_sized_by_real_tokens(batch: TargetBatch, meta: AttentionMetadata) -> None:
    unpadded = (torch.zeros(9, dtype=torch.int64), torch.arange(9))
    assert violated(batch, meta, "shapes", inputs=unpadded) == "TGT-1"


@pytest.mark.parametrize("where", ["host mirror", "device only"])
def test_pad1_padded_query_start_loc_of_minus_one(batch: TargetBatch, meta: AttentionMetadata, where: str) -> None:
    bad = i32([0, 3, 6, 9, -1])
    mirror = bad.clone() if where == "host mirror" else None
    assert violated(batch, dataclasses.replace(meta, query_start_loc=bad, query_start_loc_cpu=mirror)) == "PAD-1"


def test_pad1_query_start_loc_not_padded(batch: TargetBatch, meta: AttentionMetadata) -> None:
    unpadded = i32([0, 3, 6, 9])
    assert violated(batch, corrupt(meta, query_start_loc=unpadded, query_start_loc_cpu=unpadded), "shapes") == "PAD-1"


def test_pad2_padded_request_given_a_context_length(batch: TargetBatch, meta: AttentionMetadata) -> None:
    bad = i32([8, 3, 12, 12])
    assert violated(batch, dataclasses.replace(meta, seq_lens=bad, seq_lens_cpu=bad.clone())) == "PAD-2"


def test_pad2_new_tokens_not_counted_in_seq_len(batch: TargetBatch, meta: AttentionMetadata) -> None:
    bad = i32([8, 2, 12, 0])  # request b: seq_len 2 < query_len 3
    assert violated(batch, dataclasses.replace(meta, seq_lens=bad, seq_lens_cpu=None)) == "PAD-2"


def test_kv3_target_slot_mapping_shorter_than_padded_tokens(batch: TargetBatch, meta: AttentionMetadata) -> None:
    short = meta.slot_mapping[:9].clone()
    assert violated(batch, dataclasses.replace(meta, slot_mapping=short), "shapes") == "KV-3"


def test_kv3_target_padded_rows_not_pad_slot(batch: TargetBatch, meta: AttentionMetadata) -> None:
    bad = meta.slot_mapping.clone()
    bad[9:] = 0  # padded tokens would overwrite block 0, which request a owns
    assert violated(batch, dataclasses.replace(meta, slot_mapping=bad)) == "KV-3"


def test_tgt4_duplicated_real_slot(batch: TargetBatch, meta: AttentionMetadata) -> None:
    bad = meta.slot_mapping.clone()
    bad[4] = bad[3]
    assert violated(batch, dataclasses.replace(meta, slot_mapping=bad)) == "TGT-4"


def test_tgt4_slot_outside_the_requests_blocks(batch: TargetBatch, meta: AttentionMetadata) -> None:
    bad = meta.slot_mapping.clone()
    foreign = 15  # a free block that no request holds
    assert all(foreign not in batch.kv.block_table(r.req_id) for r in batch.requests)
    bad[6] = foreign * BLOCK_SIZE
    assert violated(batch, dataclasses.replace(meta, slot_mapping=bad)) == "TGT-4"


def test_tgt4_slot_in_block_zero_that_belongs_to_another_request(batch: TargetBatch, meta: AttentionMetadata) -> None:
    assert batch.kv.block_table("a")[0] == 0 and batch.kv.block_table("b") == [5]
    bad = meta.slot_mapping.clone()
    bad[3] = 0  # request b would overwrite position 0 of request a
    assert violated(batch, dataclasses.replace(meta, slot_mapping=bad)) == "TGT-4"


def test_pad3_block_table_rows_not_padded(batch: TargetBatch, meta: AttentionMetadata) -> None:
    assert violated(batch, corrupt(meta, block_table=meta.block_table[:3].clone()), "shapes") == "PAD-3"


@pytest.mark.parametrize(
    "changes",
    [
        {"num_tokens_padded": 9},  # attention sized by the real tokens
        {"num_reqs": 4},  # padded count reported as real
        {"num_tokens": 12},
        {"max_query_len": 1},  # decode-style metadata over a verify batch
    ],
    ids=lambda c: next(iter(c)),
)
def test_tgt7_counts_from_another_padding_level(
    batch: TargetBatch, meta: AttentionMetadata, changes: dict[str, int]
) -> None:
    assert violated(batch, dataclasses.replace(meta, **changes), "shapes") == "TGT-7"


def cache_violation(facts: Any) -> str:
    with enforce("shapes"), pytest.raises(ContractViolation) as err:
        check(Subject.CACHE, facts, step_kind=StepKind.CACHE, component="kv_cache")
    return err.value.invariant_id


def test_kv1_duplicated_block(batch: TargetBatch) -> None:
    facts = batch.kv.facts()
    tables = dict(facts.block_tables)
    tables["b"] = (*tables["b"], tables["a"][0])  # a block booked by two requests
    assert cache_violation(dataclasses.replace(facts, block_tables=tables)) == "KV-1"


def test_kv1_finished_request_still_holding_blocks(batch: TargetBatch) -> None:
    facts = batch.kv.facts()  # a free() that marked "a" finished but forgot to release its blocks
    assert cache_violation(dataclasses.replace(facts, finished_requests=("a",))) == "KV-1"


def test_kv1_lost_block(batch: TargetBatch) -> None:
    facts = batch.kv.facts()
    assert cache_violation(dataclasses.replace(facts, free_blocks=tuple(facts.free_blocks)[1:])) == "KV-1"


def test_kv2_cache_length_not_rolled_back(batch: TargetBatch) -> None:
    kv = batch.kv
    for r in batch.requests:  # the verify forward wrote all K+1 positions
        kv.set_length(r.req_id, r.seq_len)
    committed = {"a": 6, "b": 3, "c": 11}  # a: 0 accepted, b: all, c: 1 accepted (+ bonus each)
    with enforce("shapes"):
        with pytest.raises(ContractViolation) as err:
            kv.check(committed_lengths=committed)
        assert err.value.invariant_id == "KV-2"
        for req, n in committed.items():
            kv.truncate(req, n)
        kv.check(committed_lengths=committed)


# -- shape-only runs -------------------------------------------------------------------------------


def test_shapes_mode_reads_no_device_value_on_fake_cuda(batch: TargetBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FakeTensorMode every tensor (host mirrors too) is fake: values cannot be read, shapes still can."""
    reads: list[Any] = []
    for name in ("host", "device"):
        original = getattr(ValueReader, name)

        def spy(self: ValueReader, t: Any, _original: Any = original) -> Any:
            value = _original(self, t)
            if value is not None:
                reads.append(value)
            return value

        monkeypatch.setattr(ValueReader, name, spy)

    with FakeTensorMode(), enforce("shapes"):
        meta = build_target_metadata(batch.requests, batch.desc, batch.kv, device="cuda")
        assert meta.slot_mapping.device.type == "cuda" and meta.block_table.device.type == "cuda"
        ids = torch.zeros(batch.desc.num_tokens, dtype=torch.int64, device="cuda")
        positions = build_positions(batch.requests, batch.desc, device="cuda")
        check_target_batch(batch.desc, batch.requests, meta, ids, positions, BLOCK_SIZE)

        # wrong values are invisible here (nothing is read), ...
        garbage = dataclasses.replace(
            meta,
            query_start_loc=torch.full((5,), -1, dtype=torch.int32, device="cuda"),
            query_start_loc_cpu=torch.full((5,), -1, dtype=torch.int32),
            slot_mapping=torch.zeros(12, dtype=torch.int64, device="cuda"),
        )
        check_target_batch(batch.desc, batch.requests, garbage, ids, positions, BLOCK_SIZE)

        # ... but a wrong length is a shape, and the [S] part of KV-3 still catches it
        short = dataclasses.replace(meta, slot_mapping=torch.full((9,), PAD_SLOT_ID, dtype=torch.int64, device="cuda"))
        with pytest.raises(ContractViolation) as err:
            check_target_batch(batch.desc, batch.requests, short, ids, positions, BLOCK_SIZE)
        assert err.value.invariant_id == "KV-3"
        assert err.value.observed == {"slot_mapping shape": (9,), "desc.num_tokens": 12}
    assert reads == []


def test_host_mirrors_are_checked_in_shapes_mode_without_touching_the_device(batch: TargetBatch) -> None:
    """With device tensors on meta, [H] checks still read the host mirrors."""
    with enforce("shapes"):
        meta = build_target_metadata(batch.requests, batch.desc, batch.kv, device="meta")
        ids = torch.zeros(12, dtype=torch.int64, device="meta")
        positions = build_positions(batch.requests, batch.desc, device="meta")
        check_target_batch(batch.desc, batch.requests, meta, ids, positions, BLOCK_SIZE)
    bad = dataclasses.replace(meta, query_start_loc_cpu=i32([0, 3, 6, 9, -1]))
    assert violated(batch, bad, "shapes", inputs=(ids, positions)) == "PAD-1"


# -- builder edge cases ----------------------------------------------------------------------------


def test_builder_requires_reserved_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    kv.add_request("a")
    requests = [ScheduledRequest("a", 0, 5)]
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=5, num_reqs=1)
    with pytest.raises(KVCacheError, match="reserve"):
        build_target_metadata(requests, desc, kv)
    reserve(requests, kv)
    assert kv.capacity("a") == 8


def test_reserve_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    for r in ("a", "b"):
        kv.add_request(r)
    with pytest.raises(OutOfBlocksError):
        reserve([ScheduledRequest("a", 0, 8), ScheduledRequest("b", 0, 5)], kv)
    assert kv.num_free_blocks == 3 and kv.block_table("a") == []


def test_descriptor_too_small_for_the_batch() -> None:
    batch = verify_batch()
    small = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=8)
    with enforce("shapes"), pytest.raises(ContractViolation) as err:
        build_target_metadata(batch.requests, small, batch.kv)
    assert err.value.invariant_id == "DESC-5"
    with enforce("off"), pytest.raises(ValueError, match="cannot hold"):
        build_target_metadata(batch.requests, small, batch.kv)


def test_builder_checks_inputs_it_is_given_and_fixed_table_width(batch: TargetBatch) -> None:
    with enforce("shapes"):
        with pytest.raises(ContractViolation) as err:
            unpadded = torch.zeros(9, dtype=torch.int64)
            build_target_metadata(batch.requests, batch.desc, batch.kv, input_ids=unpadded, positions=unpadded)
        assert err.value.invariant_id == "TGT-1"
        meta = build_target_metadata(batch.requests, batch.desc, batch.kv, max_blocks=8)
        assert tuple(meta.block_table.shape) == (4, 8)
        with pytest.raises(ValueError, match="narrower"):
            build_target_metadata(batch.requests, batch.desc, batch.kv, max_blocks=2)


def test_scheduled_request_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="query_len"):
        ScheduledRequest("a", 0, 0)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        ScheduledRequest("a", -1, 1)


def test_pad1_device_copy_disagreeing_with_its_host_mirror(batch: TargetBatch, meta: AttentionMetadata) -> None:
    """A right host mirror cannot hide a device query_start_loc padded with -1 in ``full`` mode."""
    device_copy = meta.query_start_loc.clone()
    device_copy[-1] = -1
    bad = dataclasses.replace(meta, query_start_loc=device_copy)
    assert violated(batch, bad, "full") == "PAD-1"


def test_piecewise_attention_runs_on_the_real_rows_only() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    requests = [ScheduledRequest("a", 2, 3), ScheduledRequest("b", 0, 2)]
    for r in requests:
        kv.add_request(r.req_id)
    reserve(requests, kv)
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=8)
    with enforce("full"):
        meta = build_target_metadata(requests, desc, kv)
    assert (meta.num_tokens, meta.num_tokens_padded, meta.slot_mapping.shape[0]) == (5, 5, 8)
