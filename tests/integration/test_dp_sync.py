"""DP sync over in-process ranks: one result on every rank, padding rules, collective accounting."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings

from contracts import (
    BatchExecutionDescriptor,
    ContractViolation,
    CUDAGraphMode,
    DPFacts,
    DPSyncState,
    StepKind,
    Subject,
    check,
)
from specdec.dispatch import CaptureConfig, dispatch
from specdec.dp_group import DPCollectiveTimeout, InProcessDPGroup, in_process_world, run_ranks
from specdec.dp_sync import IDLE_DUMMY_TOKENS, sync_dp
from specdec.testing import StepConfig, step_configs


def run_sync(cfg: StepConfig) -> list[tuple[DPSyncState, BatchExecutionDescriptor]]:
    groups = in_process_world(cfg.dp_size, timeout_s=10.0)

    def one(group: InProcessDPGroup) -> tuple[DPSyncState, BatchExecutionDescriptor]:
        batch = cfg.ranks[group.rank]
        return sync_dp(group, batch.num_reqs, batch.num_tokens, batch.uniform_token_count, cfg.capture)

    return run_ranks(one, groups)


@settings(max_examples=80)
@given(step_configs())
def test_sync_result_identical_and_rules_hold(cfg: StepConfig) -> None:
    results = run_sync(cfg)
    states = {state for state, _ in results}
    assert len(states) == 1, "every rank must leave the sync with the same state (DP-3)"
    state = results[0][0]
    busy = [b for b in cfg.ranks if b.num_tokens > 0]
    if not busy:
        assert state.all_idle and all(d.num_tokens == 0 for _, d in results)
        return
    # the minimum of the locally dispatched modes wins; idle ranks do not veto
    local_modes = [dispatch(b.num_reqs, b.num_tokens, b.uniform_token_count, cfg.capture).cg_mode for b in busy]
    assert state.cg_mode <= min(local_modes)
    for batch, (_, desc) in zip(cfg.ranks, results, strict=True):
        assert desc.num_tokens >= batch.num_tokens
        if state.cg_mode is CUDAGraphMode.NONE:
            assert desc.num_tokens == (batch.num_tokens or IDLE_DUMMY_TOKENS)
            assert desc.num_reqs == batch.num_reqs
        else:
            assert len({d.num_tokens for _, d in results}) == 1
            assert desc.num_tokens >= max(b.num_tokens for b in cfg.ranks)


@settings(max_examples=40)
@given(step_configs(uniform_q=1))
def test_uneven_decode_ranks_pad_to_one_count(cfg: StepConfig) -> None:
    results = run_sync(cfg)
    state = results[0][0]
    if state.cg_mode is not CUDAGraphMode.NONE:
        assert set(state.num_tokens_across_dp) == {results[0][1].num_tokens}


def test_one_eager_rank_forces_every_rank_eager() -> None:
    capture = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16))
    from specdec.testing import RankBatch

    # rank 2's 40 tokens exceed every capture size, so it can only run eager
    cfg = StepConfig(capture, (RankBatch((1,) * 12), RankBatch((1,) * 13), RankBatch((20, 20)), RankBatch(())))
    results = run_sync(cfg)
    state = results[0][0]
    assert state.cg_mode is CUDAGraphMode.NONE
    assert state.num_tokens_across_dp == (12, 13, 40, IDLE_DUMMY_TOKENS)
    assert [d.num_tokens for _, d in results] == [12, 13, 40, 1]
    assert [d.num_reqs for _, d in results] == [12, 13, 2, 0]


def test_all_idle_runs_nothing() -> None:
    from specdec.testing import RankBatch

    capture = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(8,))
    results = run_sync(StepConfig(capture, (RankBatch(()),) * 4))
    assert all(s.all_idle and s.cg_mode is CUDAGraphMode.NONE and d.num_tokens == 0 for s, d in results)


def test_motivating_layout_pads_twelve_to_thirteen_eagerly() -> None:
    from specdec.testing import RankBatch

    ranks = tuple(RankBatch((1,) * (12 if r == 3 else 13)) for r in range(8))
    results = run_sync(StepConfig(CaptureConfig(mode=CUDAGraphMode.PIECEWISE, capture_sizes=(13, 16)), ranks))
    _, desc = results[3]
    assert desc.cg_mode is CUDAGraphMode.PIECEWISE and desc.num_tokens == 13 and desc.num_reqs is None


def test_skipped_collective_times_out_with_a_clear_error() -> None:
    groups = in_process_world(2, timeout_s=0.5)
    cfg = CaptureConfig()

    def step(group: InProcessDPGroup) -> None:
        if group.rank == 0:  # rank 0 skips drafting's collective
            sync_dp(group, 1, 1, 1, cfg)
            return
        sync_dp(group, 1, 1, 1, cfg)
        sync_dp(group, 1, 1, 1, cfg)

    start = time.monotonic()
    with pytest.raises(DPCollectiveTimeout, match=r"ranks \[0\] never joined .*DP-3"):
        run_ranks(step, groups)
    assert time.monotonic() - start < 5


def test_mismatched_collective_counts_are_dp_3() -> None:
    groups = in_process_world(2, timeout_s=5.0)
    cfg = CaptureConfig()

    def step(group: InProcessDPGroup) -> None:
        sync_dp(group, 1, 1, 1, cfg, purpose="target")
        if group.rank == 0:  # rank 0 drafts with its own sync; rank 1 skipped it
            sync_dp(group, 1, 1, 1, cfg, purpose="draft")
        else:  # ... and went on to the next step's target sync, which pairs with rank 0's draft sync
            sync_dp(group, 1, 1, 1, cfg, purpose="target")

    with pytest.raises(ContractViolation) as info:
        run_ranks(step, groups)
    assert info.value.invariant_id == "DP-3"


def _none(num_tokens: int, num_reqs: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (
            DPFacts(
                DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.PIECEWISE, num_tokens_across_dp=(16, 8)),
                BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=16),
                0,
                12,
            ),
            "DP-1",
        ),
        (
            DPFacts(
                DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(13, 12)), _none(13, 12), 1, 12
            ),
            "DP-2",
        ),
        (
            DPFacts(
                DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 4)),
                _none(3, 3),
                0,
                3,
                collective_seqs=((4, 7), (5, 7)),
            ),
            "DP-3",
        ),
        (
            DPFacts(
                DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 4)),
                _none(3, 3),
                0,
                3,
                peer_states=[
                    DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 4)),
                    DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 5)),
                ],
            ),
            "DP-3",
        ),
    ],
)
def test_dp_invariants_trigger(facts: DPFacts, expected: str) -> None:
    with pytest.raises(ContractViolation) as info:
        check(Subject.DP, facts, step_kind=StepKind.DP_SYNC, component="test")
    assert info.value.invariant_id == expected
