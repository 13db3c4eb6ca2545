"""KV-3 and KV-4 on planted facts, ``KVCacheManager.commit`` and the committed-token view a drafter reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import decode_facts

import contracts
from contracts import PAD_SLOT_ID, BatchFacts, ContractViolation, StepKind, Subject, check
from specdec.kv_cache import KVCacheError, KVCacheManager
from specdec.request import Request, TokenHistory
from specdec.sampling import SamplingParams

DECODE, PREFILL = StepKind.DRAFT_DECODE, StepKind.DRAFT_PREFILL


def _prefill_facts() -> BatchFacts:
    facts = decode_facts()
    return dataclasses.replace(facts, target_desc=facts.desc, last_token_indices=torch.arange(12, dtype=torch.int64))


def _padded_row_writes(facts: BatchFacts, slot: int) -> BatchFacts:
    """The padded model row (row 12 of 13) writes ``slot`` of the draft cache, a live one."""
    slots = facts.meta.slot_mapping.clone()
    slots[12] = slot
    return dataclasses.replace(facts, meta=dataclasses.replace(facts.meta, slot_mapping=slots))


@pytest.mark.parametrize(("kind", "build"), [(DECODE, decode_facts), (PREFILL, _prefill_facts)])
def test_kv_3_catches_a_padded_draft_row_writing_a_live_slot(kind: StepKind, build: object) -> None:
    facts = build()  # type: ignore[operator]
    assert int(facts.meta.slot_mapping[12]) == PAD_SLOT_ID
    with contracts.enforce("full"):
        check(Subject.BATCH, facts, step_kind=kind, component="test")  # correct facts are silent
        with pytest.raises(ContractViolation) as info:
            check(Subject.BATCH, _padded_row_writes(facts, 17), step_kind=kind, component="test")
    assert info.value.invariant_id == "KV-3"
    assert "(padded row, slot) written" in str(info.value)


def test_kv_3_reads_the_device_slot_mapping_only_in_full_mode() -> None:
    with contracts.enforce("shapes"):
        check(Subject.BATCH, _padded_row_writes(decode_facts(), 17), step_kind=DECODE, component="test")


def _cache_with_two_requests() -> KVCacheManager:
    kv = KVCacheManager(8, 4)
    for rid, n in (("a", 5), ("b", 3)):
        kv.add_request(rid)
        kv.ensure_capacity(rid, n)
        kv.set_length(rid, n)
    return kv


def test_kv_4_catches_blocks_held_by_a_request_that_no_longer_runs() -> None:
    kv = _cache_with_two_requests()
    with contracts.enforce("shapes"):
        kv.check(live_requests={"a", "b"})
        kv.check()  # without the engine's account there is nothing to compare to
        with pytest.raises(ContractViolation) as info:
            kv.check(live_requests={"a"}, component="draft cache 'test'")
    assert info.value.invariant_id == "KV-4"
    assert "'b'" in str(info.value) and "draft cache 'test'" in str(info.value)


def test_kv_4_is_silent_for_a_registered_request_without_blocks() -> None:
    kv = _cache_with_two_requests()
    kv.truncate("b", 0)
    with contracts.enforce("shapes"):
        kv.check(live_requests={"a"})


def test_commit_sets_the_length_and_releases_blocks_past_it() -> None:
    kv = KVCacheManager(8, 4)
    kv.add_request("a")
    kv.ensure_capacity("a", 12)
    kv.set_length("a", 2)
    assert kv.commit("a", 6) == [2]  # rows up to 6 were written: the third block is released
    assert kv.length("a") == 6 and len(kv.block_table("a")) == 2
    assert kv.commit("a", 3) == [1]
    assert kv.length("a") == 3 and kv.num_free_blocks == 7
    with pytest.raises(KVCacheError, match="capacity is 4 tokens"):
        kv.commit("a", 9)


def test_token_history_is_a_view_of_the_first_tokens() -> None:
    req = Request("r", [5, 6, 7], SamplingParams(), max_tokens=8)
    req.output.extend([8, 9])
    view = req.history(4)
    assert len(view) == 4 and list(view) == [5, 6, 7, 8] and view[-1] == 8 and view[1:3] == [6, 7]
    req.output.append(10)  # the request grows; the step's view does not
    assert tuple(view) == (5, 6, 7, 8) and [*view, 99] == [5, 6, 7, 8, 99]
    with pytest.raises(IndexError, match="outside a history of 4"):
        view[4]
    with pytest.raises(ValueError, match="does not fit a request of 6"):
        TokenHistory(req.prompt, req.output, 7)
