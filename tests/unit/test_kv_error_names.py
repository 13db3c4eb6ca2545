"""A KV addressing error raised inside a drafter names the draft cache, its backend, the request and the position."""

from __future__ import annotations

import pytest

from backends import create
from contracts import StepKind
from specdec.dispatch import CaptureConfig
from specdec.engine import Engine, EngineConfig
from specdec.kv_cache import KVCacheError, KVCacheManager, OutOfBlocksError
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.speculator import DraftContext

DRAFT_CACHE = "draft cache 'ar' of backend 'my-drafter'"


def _ctx(num_blocks: int = 4) -> DraftContext:
    return DraftContext(
        backend="my-drafter",
        step_kinds=frozenset({StepKind.DRAFT_DECODE}),
        capture=CaptureConfig(),
        dp_group=None,
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=64,
        max_num_seqs=1,
    )


def test_a_position_past_the_reserved_blocks_names_the_drafter_and_the_position() -> None:
    cache = _ctx().new_cache("ar", lookahead_tokens=4)
    cache.add_request("a")
    cache.ensure_capacity("a", 4)
    with pytest.raises(KVCacheError) as info:
        cache.slot_mapping("a", [9])
    message = str(info.value)
    assert message.startswith(DRAFT_CACHE) and "request 'a'" in message and "position 9" in message
    assert "lookahead_tokens=4" in message and "ensure_capacity" in message


def test_every_bookkeeping_error_of_a_draft_cache_names_it() -> None:
    cache = _ctx(num_blocks=1).new_cache("ar")
    cache.add_request("a")
    with pytest.raises(OutOfBlocksError, match=f"^{DRAFT_CACHE}: out of KV blocks: request 'a'"):
        cache.ensure_capacity("a", 64)
    with pytest.raises(OutOfBlocksError, match=f"^{DRAFT_CACHE}: out of KV blocks"):
        cache.ensure_capacities({"a": 64})
    with pytest.raises(KVCacheError, match=f"^{DRAFT_CACHE}: request 'a': cannot set cached length 9"):
        cache.set_length("a", 9)
    with pytest.raises(KVCacheError, match=f"^{DRAFT_CACHE}: request 'b' is not in the cache"):
        cache.length("b")
    cache.ensure_capacity("a", 4)
    cache._tables["a"].append(cache._tables["a"][0])  # a block listed twice: a double free when released
    with pytest.raises(KVCacheError, match=f"^{DRAFT_CACHE}: request 'a': block 0 appears twice"):
        cache.free("a")


def test_an_unnamed_cache_keeps_its_plain_messages() -> None:
    cache = KVCacheManager(1, 4)
    cache.add_request("a")
    with pytest.raises(KVCacheError, match=r"^request 'a': position 4 is outside"):
        cache.slot_mapping("a", [4])


def test_a_drafter_that_skips_its_reservation_fails_naming_its_cache() -> None:
    """EAGLE's decode with its ``ensure_capacity`` lost: the first speculative position past seq_len is named."""
    target = Transformer(ModelConfig.tiny(), seed=0)
    engine = Engine(
        target, EngineConfig(num_blocks=64, block_size=4), speculator=create("eagle", target, num_spec_tokens=3)
    )
    assert engine.draft_ctx is not None
    cache = engine.draft_ctx.caches["autoregressive"]
    cache.ensure_capacity = lambda req_id, num_tokens_total: []  # type: ignore[method-assign]
    engine.add_request("a", [3, 4, 5, 6], max_tokens=8)
    with pytest.raises(KVCacheError) as info:
        engine.run(max_steps=20)
    message = str(info.value)
    assert message.startswith("draft cache 'autoregressive' of backend 'eagle': request 'a': position ")
    assert "lookahead_tokens=4" in message
