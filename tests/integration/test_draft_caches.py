"""The engine commits and rolls back every draft cache; KV-3 and KV-4 catch what a drafter could still get wrong.

After every step each draft cache holds exactly the committed length of every
running request, in exactly the blocks that length needs, and nothing for any
other request, whatever the drafter (EAGLE, a draft model, DFlash, DSpark),
under chunked prefill, preemption and CUDA graph padding. Each new check is
shown firing on a planted bug and silent on the same run without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import contracts
from backends import create
from contracts import ContractViolation, CUDAGraphMode
from specdec.dispatch import CaptureConfig
from specdec.draft_caches import DraftCacheError, open_cache
from specdec.engine import Engine, EngineConfig
from specdec.kv_cache import KVCacheManager, blocks_for
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.request import Request
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep

TARGET = Transformer(ModelConfig.tiny(), seed=3)
PADDED = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
PROMPTS = {"a": [5, 9, 14, 3, 7, 11, 2], "b": [8, 1, 4], "c": [12, 6, 10, 13, 15]}


def make_engine(speculator: Speculator, *, num_blocks: int = 64, capture: CaptureConfig = PADDED) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=2,
        capture=capture,
        scheduler=SchedulerConfig(max_num_batched_tokens=9, max_num_seqs=3, max_model_len=48),
    )
    engine = Engine(TARGET, config, speculator=speculator)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, max_tokens={"a": 14, "b": 4, "c": 10}[rid])
    return engine


def plain_outputs() -> dict[str, list[int]]:
    engine = Engine(TARGET, EngineConfig(num_blocks=256, block_size=2))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, max_tokens={"a": 14, "b": 4, "c": 10}[rid])
    return engine.run()


def assert_draft_caches_committed(engine: Engine) -> None:
    assert engine.draft_ctx is not None
    running = {r.req_id: r.num_computed for r in engine.scheduler.running}
    for name, cache in engine.draft_ctx.caches.items():
        for rid in cache.requests:
            if rid not in running:
                assert cache.block_table(rid) == [], f"{name}: {rid} no longer runs but holds draft blocks"
        for rid, n in running.items():
            assert cache.length(rid) == n, f"{name}: {rid} holds {cache.length(rid)} tokens, committed {n}"
            assert len(cache.block_table(rid)) == blocks_for(n, cache.block_size), f"{name}: {rid} over-allocated"


@pytest.mark.parametrize("backend", ["eagle", "draft-model", "dflash", "dspark"])
@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "preempting"])
def test_every_draft_cache_holds_exactly_the_committed_tokens_after_every_step(backend: str, num_blocks: int) -> None:
    engine = make_engine(create(backend, TARGET, num_spec_tokens=3), num_blocks=num_blocks)
    finished: dict[str, Request] = {}
    with contracts.enforce("full"):
        while engine.has_work:
            finished.update(engine.step().finished)
            assert_draft_caches_committed(engine)
    assert {rid: r.output for rid, r in finished.items()} == plain_outputs()
    assert engine.draft_ctx is not None and all(c.requests == () for c in engine.draft_ctx.caches.values())
    if num_blocks == 14:
        assert sum(r.metrics.preemptions for r in finished.values()) > 0, "sized to preempt"


def test_open_refuses_a_draft_cache_whose_length_was_set_outside_the_engine() -> None:
    from specdec.attn_metadata import ScheduledRequest

    cache = KVCacheManager(8, 2)
    step: Any = type("Step", (), {"scheduled": (ScheduledRequest("a", 0, 3),)})()
    open_cache("test", cache, step)
    assert cache.length("a") == 0 and cache.capacity("a") >= 3
    cache.set_length("a", 3)  # a drafter committing its own rows
    later: Any = type("Step", (), {"scheduled": (ScheduledRequest("a", 2, 1),)})()
    with pytest.raises(DraftCacheError, match="holds 3 tokens of request 'a' but the target step starts at 2"):
        open_cache("test", cache, later)


# -- KV-3: a padded draft row never writes a live slot ---------------------------------------------------------


def _padded_rows_write(real: Callable[..., Any], real_rows: Callable[[Any], int]) -> Callable[..., Any]:
    """A metadata builder whose padded model rows write the first request's first slot."""

    def build(*args: Any, **kwargs: Any) -> Any:
        meta = real(*args, **kwargs)
        slots = meta.slot_mapping.clone()
        n = real_rows(meta)
        if 0 < n < slots.shape[0]:
            slots[n:] = slots[0]
        return dataclasses.replace(meta, slot_mapping=slots)

    return build


@pytest.mark.parametrize("builder", ["build_decode_metadata", "build_target_metadata"])
def test_kv_3_catches_a_padded_draft_row_that_writes_a_live_slot(builder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.autoregressive.speculator as ar

    real = getattr(ar, builder)
    monkeypatch.setattr(ar, builder, _padded_rows_write(real, lambda meta: meta.num_tokens))
    engine = make_engine(create("eagle", TARGET, num_spec_tokens=3))
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        engine.run()
    assert info.value.invariant_id == "KV-3"
    monkeypatch.setattr(ar, builder, real)
    correct = make_engine(create("eagle", TARGET, num_spec_tokens=3))
    with contracts.enforce("full"):
        assert correct.run() == plain_outputs()


# -- KV-4: only running requests hold draft blocks after a step ------------------------------------------------


class _HoldsBlocksOfFinished:
    """A drafter that allocates draft blocks again for the requests that finished before this step."""

    def __init__(self, inner: Speculator) -> None:
        self.inner = inner
        self.name, self.num_spec_tokens = inner.name, inner.num_spec_tokens
        self.draft_step_kinds, self.aux_layers = inner.draft_step_kinds, inner.aux_layers
        self.finished: list[str] = []

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = self.inner.propose(step, ctx)
        for rid in self.finished:
            cache = ctx.caches["autoregressive"]
            if rid not in cache:
                cache.add_request(rid)
            cache.ensure_capacity(rid, 4)
        return proposal

    def finish(self, req_id: str) -> None:
        self.finished.append(req_id)
        self.inner.finish(req_id)


def test_kv_4_catches_a_drafter_that_allocates_draft_blocks_for_a_finished_request() -> None:
    engine = make_engine(_HoldsBlocksOfFinished(create("eagle", TARGET, num_spec_tokens=3)))
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as info:
        engine.run()
    assert info.value.invariant_id == "KV-4"
    assert "requests not running but holding blocks" in str(info.value)


def test_kv_4_catches_an_engine_close_that_skips_the_free(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.speculator

    def close_without_free(name: str, cache: KVCacheManager, step: TargetStep, running: Any) -> None:
        for rid, n in step.committed_lengths.items():
            cache.commit(rid, n)
        cache.check(running, live_requests=running.keys(), component=f"draft cache {name!r}")

    monkeypatch.setattr(specdec.speculator, "close_cache", close_without_free)
    engine = make_engine(create("dflash", TARGET, num_spec_tokens=3))
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as info:
        engine.run()
    assert info.value.invariant_id == "KV-4"


def test_a_preempted_request_that_keeps_its_draft_blocks_is_refused_when_it_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the release the request comes back (here in the very step that preempted it) at 0 tokens."""
    monkeypatch.setattr(DraftContext, "release", lambda self, req_ids: None)
    engine = make_engine(create("draft-model", TARGET, num_spec_tokens=3), num_blocks=14)
    with contracts.enforce("shapes"), pytest.raises(DraftCacheError, match="but the target step starts at 0"):
        engine.run()
