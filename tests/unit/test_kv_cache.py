"""Paged KV cache: bookkeeping as a state machine against a model, slot addressing, and the tensor store."""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch._subclasses.fake_tensor import FakeTensorMode

from contracts import PAD_SLOT_ID, ContractViolation, enforce
from specdec.kv_cache import BlockPool, KVCacheError, KVCacheManager, OutOfBlocksError, blocks_for
from specdec.kv_storage import PagedKVStorage

# -- helpers ---------------------------------------------------------------------------------------


def snapshot(kv: KVCacheManager) -> tuple[Any, ...]:
    """Everything observable about the bookkeeping, comparable with ==."""
    facts = kv.facts()
    return (
        tuple(facts.free_blocks),
        {r: tuple(t) for r, t in facts.block_tables.items()},
        dict(facts.cache_lengths or {}),
        tuple(facts.finished_requests),
    )


def unchecked(fn: Any) -> Any:
    """The function without the jaxtyping wrapper the test hook adds: production runs without it,
    so the kernel-style validation must stand on its own."""
    return inspect.unwrap(fn)


# -- BlockPool -------------------------------------------------------------------------------------


def test_block_pool_hands_out_and_takes_back_blocks() -> None:
    pool = BlockPool(4)
    assert (pool.num_free, pool.num_total) == (4, 4)
    taken = pool.allocate(3, owner="r0")
    assert sorted(taken) == [0, 1, 2]
    assert pool.num_free == 1
    pool.free(taken[:2])
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted([*taken[:2], 3])


def test_block_pool_rejects_double_and_foreign_frees_without_changing_state() -> None:
    pool = BlockPool(4)
    taken = pool.allocate(2)
    pool.free([taken[0]])
    before = pool.free_blocks
    with pytest.raises(KVCacheError, match="not in use"):
        pool.free([taken[1], taken[0]])  # taken[0] already free; taken[1] must not be freed either
    assert pool.free_blocks == before
    with pytest.raises(KVCacheError, match="twice"):
        pool.free([taken[1], taken[1]])
    with pytest.raises(KVCacheError, match="out of range"):
        pool.free([7])
    assert pool.free_blocks == before


def test_out_of_blocks_names_request_needed_free_and_total() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError) as err:
        pool.allocate(2, owner="req-7")
    assert (err.value.req_ids, err.value.needed, err.value.free, err.value.total) == (("req-7",), 2, 1, 3)
    message = str(err.value)
    assert "'req-7'" in message and "2 more block" in message and "1 of 3" in message
    assert pool.num_free == 1


# -- KVCacheManager: examples ----------------------------------------------------------------------


def test_out_of_blocks_is_atomic_for_one_request_and_for_a_batch() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    for r in ("a", "b"):
        kv.add_request(r)
    kv.ensure_capacity("a", 9)  # 3 blocks
    kv.set_length("a", 9)
    before = snapshot(kv)
    with pytest.raises(OutOfBlocksError, match="'b'"):
        kv.ensure_capacity("b", 12)  # needs 3, 2 free
    assert snapshot(kv) == before
    with pytest.raises(OutOfBlocksError) as err:
        kv.ensure_capacities({"a": 13, "b": 8})  # 1 + 2 > 2: neither may grow
    assert err.value.needed == 3 and set(err.value.req_ids) == {"a", "b"}
    assert snapshot(kv) == before
    kv.ensure_capacities({"a": 13, "b": 4})
    assert (kv.capacity("a"), kv.capacity("b"), kv.num_free_blocks) == (16, 4, 0)


def test_verify_rollback_frees_rejected_blocks_and_kv2_sees_a_missing_rollback() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.add_request("r")
    kv.ensure_capacity("r", 7)
    kv.set_length("r", 7)
    # verify K=4 drafts + bonus: the forward writes 5 more positions
    kv.ensure_capacity("r", 12)
    kv.set_length("r", 12)
    committed = {"r": 7 + 1 + 1}  # one draft accepted, plus the bonus token
    with enforce("shapes"):
        with pytest.raises(ContractViolation) as err:
            kv.check(committed_lengths=committed)
        assert err.value.invariant_id == "KV-2"
        released = kv.truncate("r", 9)
        kv.check(committed_lengths=committed)
    assert len(released) == 0  # 9 tokens still need 3 blocks
    assert kv.length("r") == 9 and kv.capacity("r") == 12
    assert kv.truncate("r", 4) != [] and kv.capacity("r") == 4


def test_preempt_returns_dropped_tokens_and_free_remembers_finished() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, finished_history=2)
    for r in ("a", "b", "c"):
        kv.add_request(r)
    kv.ensure_capacity("a", 3)
    kv.set_length("a", 3)
    assert kv.preempt("a") == 3
    assert (kv.length("a"), kv.block_table("a"), kv.num_free_blocks) == (0, [], 4)
    for r in ("a", "b", "c"):
        kv.free(r)
    assert kv.finished_requests == ("b", "c")  # bounded history, oldest dropped
    with pytest.raises(KVCacheError, match="has finished"):
        kv.length("c")
    kv.add_request("c")  # ids may be reused
    assert "c" not in kv.finished_requests
    with enforce("shapes"):
        kv.check()


def test_misuse_is_a_clear_error() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    with pytest.raises(KVCacheError, match="never added"):
        kv.ensure_capacity("ghost", 1)
    kv.add_request("a")
    with pytest.raises(KVCacheError, match="already"):
        kv.add_request("a")
    with pytest.raises(KVCacheError, match="capacity"):
        kv.set_length("a", 1)
    kv.ensure_capacity("a", 2)
    kv.set_length("a", 2)
    with pytest.raises(KVCacheError, match="truncate"):
        kv.truncate("a", 3)
    with pytest.raises(ValueError):
        kv.ensure_capacity("a", -1)


# -- KVCacheManager: state machine -----------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 12


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / grow / reserve / rollback / free / preempt sequences against a model of lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.lengths: dict[str, int] = {}
        self.finished: list[str] = []
        self.next_id = 0

    @initialize()
    def start(self) -> None:
        self.add()

    def pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.lengths)), label="request")

    def expect_atomic_failure(self, action: Any) -> bool:
        """Run ``action``; if it runs out of blocks the bookkeeping must be untouched. Returns success."""
        before = snapshot(self.kv)
        try:
            action()
        except OutOfBlocksError as err:
            event("out of blocks")
            assert snapshot(self.kv) == before
            assert err.needed > err.free == self.kv.num_free_blocks
            assert err.total == NUM_BLOCKS
            return False
        return True

    @rule()
    def add(self) -> None:
        req = f"r{self.next_id}"
        self.next_id += 1
        self.kv.add_request(req)
        self.lengths[req] = 0

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), new_tokens=st.integers(0, 3 * BLOCK_SIZE))
    def forward(self, data: st.DataObject, new_tokens: int) -> None:
        """A forward writes ``new_tokens`` positions: grow, then record the cached length."""
        req = self.pick(data)
        total = self.lengths[req] + new_tokens
        if self.expect_atomic_failure(lambda: self.kv.ensure_capacity(req, total)):
            self.kv.set_length(req, total)
            self.lengths[req] = total

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), ahead=st.integers(0, 2 * BLOCK_SIZE))
    def reserve_batch(self, data: st.DataObject, ahead: int) -> None:
        """Reserve room for a batch without writing: all requests grow or none does."""
        reqs = data.draw(st.sets(st.sampled_from(sorted(self.lengths)), min_size=1), label="batch")
        totals = {r: self.lengths[r] + ahead for r in reqs}
        if self.expect_atomic_failure(lambda: self.kv.ensure_capacities(totals)):
            assert all(self.kv.capacity(r) >= n for r, n in totals.items())

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        req = self.pick(data)
        keep = data.draw(st.integers(0, self.lengths[req]), label="keep")
        self.kv.truncate(req, keep)
        self.lengths[req] = keep
        assert self.kv.capacity(req) == blocks_for(keep, BLOCK_SIZE) * BLOCK_SIZE

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.pick(data)
        self.kv.free(req)
        del self.lengths[req]
        self.finished.append(req)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self.pick(data)
        assert self.kv.preempt(req) == self.lengths[req]
        self.lengths[req] = 0
        assert self.kv.block_table(req) == []

    @invariant()
    def contracts_hold(self) -> None:
        with enforce("shapes"):
            self.kv.check(committed_lengths=self.lengths)  # KV-1 and KV-2

    @invariant()
    def bookkeeping_matches_model(self) -> None:
        kv = self.kv
        assert set(kv.requests) == set(self.lengths)
        assert set(kv.finished_requests) == set(self.finished)
        in_use = [b for r in kv.requests for b in kv.block_table(r)]
        assert len(in_use) + kv.num_free_blocks == NUM_BLOCKS
        assert len(set(in_use)) == len(in_use)
        for req, n in self.lengths.items():
            assert kv.length(req) == n
            assert kv.capacity(req) >= n


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- slot mapping ----------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.integers(1, 8),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_slot_mapping_addresses_each_position_inside_its_own_blocks(
    block_size: int, lengths: list[int], seed: int
) -> None:
    need = [blocks_for(n, block_size) for n in lengths]
    kv = KVCacheManager(num_blocks=sum(need) + 2, block_size=block_size)
    reqs = [f"r{i}" for i in range(len(lengths))]
    for r in reqs:
        kv.add_request(r)
    # grow one block at a time in a random interleaving, so tables are not contiguous
    events = [r for r, n in zip(reqs, need, strict=True) for _ in range(n)]
    random.Random(seed).shuffle(events)
    for r in events:
        kv.ensure_capacity(r, kv.capacity(r) + 1)

    all_slots: list[int] = []
    for r, n in zip(reqs, lengths, strict=True):
        table = kv.block_table(r)
        slots = kv.slot_mapping(r, range(n))
        for pos, slot in enumerate(slots):
            assert slot // block_size == table[pos // block_size]
            assert slot % block_size == pos % block_size
        assert kv.slot_mapping(r, reversed(range(n))) == slots[::-1]
        all_slots += slots
        with pytest.raises(KVCacheError, match="outside its allocated capacity"):
            kv.slot_mapping(r, [kv.capacity(r)])
        with pytest.raises(KVCacheError):
            kv.slot_mapping(r, [-1])
    assert len(set(all_slots)) == len(all_slots)
    assert all(0 <= s < kv.num_blocks * block_size for s in all_slots)


# -- PagedKVStorage --------------------------------------------------------------------------------

HEADS, HEAD_DIM = 2, 3


def _rows(n: int, start: float) -> torch.Tensor:
    """Distinct, recognisable K/V rows."""
    return (torch.arange(n * HEADS * HEAD_DIM, dtype=torch.float32) + start).reshape(n, HEADS, HEAD_DIM)


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    chunks=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=3),
    pad_rows=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_storage_drops_pad_rows_and_gather_returns_what_was_written(
    block_size: int, chunks: list[list[int]], pad_rows: int, seed: int
) -> None:
    """Each outer list entry is one forward; each inner entry a request's query length."""
    num_reqs = max(len(c) for c in chunks)
    total = [sum(c[i] for c in chunks if i < len(c)) for i in range(num_reqs)]
    kv = KVCacheManager(num_blocks=sum(blocks_for(n, block_size) for n in total), block_size=block_size)
    store = PagedKVStorage(2, kv.num_blocks, block_size, HEADS, HEAD_DIM)
    reqs = [f"r{i}" for i in range(num_reqs)]
    expected: dict[str, list[torch.Tensor]] = {r: [] for r in reqs}
    for r in reqs:
        kv.add_request(r)
    rng = random.Random(seed)
    for step, queries in enumerate(chunks):
        slots: list[int] = []
        keys: list[torch.Tensor] = []
        for r, q in zip(reqs, queries, strict=False):
            start = kv.length(r)
            kv.ensure_capacity(r, start + q)
            slots += kv.slot_mapping(r, range(start, start + q))
            rows = _rows(q, 1000.0 * (step + 1) + 100.0 * reqs.index(r))
            keys.append(rows)
            expected[r].append(rows)
            kv.set_length(r, start + q)
        # padded rows are scattered among the real ones, carrying a poison value
        order = [("real", i) for i in range(len(slots))] + [("pad", -1)] * pad_rows
        rng.shuffle(order)
        real_keys = torch.cat(keys)
        slot_t = torch.tensor([slots[i] if kind == "real" else PAD_SLOT_ID for kind, i in order], dtype=torch.int64)
        key_t = torch.stack(
            [real_keys[i] if kind == "real" else torch.full((HEADS, HEAD_DIM), -7.0) for kind, i in order]
        )
        store.write(1, slot_t, key_t, -key_t)

    written = torch.zeros(store.num_slots, dtype=torch.bool)
    for r in reqs:
        k, v = store.gather(1, torch.tensor(kv.block_table(r), dtype=torch.int32), kv.length(r))
        want = torch.cat(expected[r])
        assert torch.equal(k, want) and torch.equal(v, -want)
        written[kv.slot_mapping(r, range(kv.length(r)))] = True
    cache = store.key_cache(1)
    assert not (cache == -7.0).any(), "a PAD row was written"
    assert not cache[~written].any(), "a slot nobody owns was written"
    assert not store.key_cache(0).any(), "another layer was written"


def test_storage_rejects_inconsistent_inputs_like_a_kernel() -> None:
    store = PagedKVStorage(1, num_blocks=2, block_size=2, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    write = unchecked(PagedKVStorage.write)
    slots = torch.tensor([0, 1, PAD_SLOT_ID])
    with pytest.raises(ValueError, match="3 entries but key has 2 rows"):
        write(store, 0, slots, _rows(2, 0), _rows(2, 0))
    with pytest.raises(ValueError, match="key must have shape"):
        write(store, 0, slots, torch.zeros(3, HEADS + 1, HEAD_DIM), torch.zeros(3, HEADS + 1, HEAD_DIM))
    with pytest.raises(ValueError, match="dtype"):
        write(store, 0, slots, _rows(3, 0).double(), _rows(3, 0).double())
    with pytest.raises(ValueError, match="integer"):
        write(store, 0, slots.float(), _rows(3, 0), _rows(3, 0))
    with pytest.raises(IndexError, match="layer 1"):
        write(store, 1, slots, _rows(3, 0), _rows(3, 0))
    with pytest.raises(ValueError, match="seq_len 5"):
        store.gather(0, torch.tensor([0, 1]), 5)


@pytest.mark.parametrize("fake_cuda", [False, True], ids=["meta", "fake-cuda"])
def test_storage_runs_shape_only_on_meta_and_fake_cuda(fake_cuda: bool) -> None:
    def run(device: str) -> None:
        store = PagedKVStorage(
            1, num_blocks=4, block_size=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=device
        )
        slots = torch.empty(5, dtype=torch.int64, device=device)
        key = torch.empty(5, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        store.write(0, slots, key, key)
        k, v = store.gather(0, torch.empty(3, dtype=torch.int32, device=device), 5)
        assert k.shape == v.shape == (5, HEADS, HEAD_DIM)
        assert k.device == store.device and k.dtype == torch.bfloat16

    if fake_cuda:
        with FakeTensorMode():
            run("cuda")
    else:
        run("meta")
