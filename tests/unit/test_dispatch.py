"""Capture-size dispatch: the descriptor that runs is valid and no larger than needed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts import CUDAGraphMode, DescriptorFacts, StepKind, Subject, check
from specdec.dispatch import CaptureConfig, dispatch
from specdec.testing import RankBatch, capture_configs, rank_batches


@given(capture_configs(), rank_batches(allow_idle=True), st.booleans())
def test_dispatch_is_valid_minimal_and_mode_capped(config: CaptureConfig, batch: RankBatch, allow_pw: bool) -> None:
    desc = dispatch(batch.num_reqs, batch.num_tokens, batch.uniform_token_count, config, allow_piecewise=allow_pw)
    check(
        Subject.DESCRIPTOR,
        DescriptorFacts(desc, batch.num_reqs, batch.num_tokens),
        step_kind=StepKind.DISPATCH,
        component="test",
    )
    assert desc.cg_mode <= config.mode
    if desc.cg_mode is CUDAGraphMode.NONE:
        assert desc.num_tokens == batch.num_tokens and desc.num_reqs == batch.num_reqs
    else:
        # A graph run pads to the smallest capture size that fits, never more.
        assert desc.num_tokens in config.capture_sizes
        smaller = [s for s in config.capture_sizes if batch.num_tokens <= s < desc.num_tokens]
        if desc.cg_mode is CUDAGraphMode.FULL:
            assert batch.uniform_token_count is not None
            assert all(s % batch.uniform_token_count for s in smaller)
        else:
            assert allow_pw and not smaller
    if (
        desc.cg_mode is CUDAGraphMode.PIECEWISE
        and batch.uniform_token_count is not None
        and config.mode is CUDAGraphMode.FULL
    ):
        # FULL was possible only if a capture size divisible by u fits.
        assert config.bucket(batch.num_tokens, batch.uniform_token_count) is None


def test_dispatch_examples() -> None:
    cfg = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16))
    assert dispatch(12, 12, 1, cfg).model_dump() == {
        "cg_mode": CUDAGraphMode.FULL,
        "num_tokens": 16,
        "num_reqs": 16,
        "uniform_token_count": 1,
    }
    # verify batch of K+1 = 3 tokens per request: 4 requests = 12 tokens, no capture size divisible by 3 -> piecewise
    assert dispatch(4, 12, 3, cfg).cg_mode is CUDAGraphMode.PIECEWISE
    assert dispatch(4, 12, 3, cfg, allow_piecewise=False).cg_mode is CUDAGraphMode.NONE
    assert dispatch(3, 40, None, cfg).cg_mode is CUDAGraphMode.NONE  # larger than every capture size
    assert dispatch(3, 5, None, cfg, min_num_tokens=9).num_tokens == 16


def test_dispatch_rejects_inconsistent_input() -> None:
    cfg = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(8,))
    with pytest.raises(ValueError, match="uniform_token_count=2 needs num_tokens == num_reqs"):
        dispatch(3, 7, 2, cfg)
    with pytest.raises(ValueError, match="non-negative"):
        dispatch(-1, 0, None, cfg)
    with pytest.raises(ValueError, match="capture sizes must be positive"):
        CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(0, 4))
