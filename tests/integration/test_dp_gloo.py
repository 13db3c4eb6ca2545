"""DP sync over real torch.distributed gloo processes on loopback, checked against in-process ranks.

Every run is bounded: collectives time out after a few seconds and the parent
kills stragglers, so a broken rank fails the test instead of hanging CI.
"""

from __future__ import annotations

import time

import pytest

from contracts import BatchExecutionDescriptor, CUDAGraphMode, DPSyncState
from specdec.dispatch import CaptureConfig
from specdec.dp_group import DPGroup, in_process_world, run_ranks
from specdec.dp_sync import sync_dp
from specdec.testing import RankBatch, StepConfig
from specdec.testing.distributed import DistributedRunError, run_gloo

pytestmark = pytest.mark.slow

FULL = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=(1, 2, 4, 8, 16, 32))
PIECEWISE = CaptureConfig(mode=CUDAGraphMode.PIECEWISE, capture_sizes=(8, 13, 64))


def scenarios(size: int) -> list[StepConfig]:
    """Uneven, idle and mixed layouts, in one process group so the counters advance too."""
    decode = tuple(RankBatch((1,) * (12 if r == size - 1 else 13)) for r in range(size))
    idle_one = tuple(RankBatch(()) if r == 0 else RankBatch((3,) * (r + 1)) for r in range(size))
    mixed = tuple(RankBatch((5, 1, 1) if r % 2 else (1,) * r) for r in range(size))
    eager = tuple(RankBatch((40, 2)) if r == 1 else RankBatch((1,)) for r in range(size))
    all_idle = tuple(RankBatch(()) for _ in range(size))
    return [
        StepConfig(FULL, decode),
        StepConfig(PIECEWISE, decode),
        StepConfig(FULL, idle_one),
        StepConfig(FULL, mixed),
        StepConfig(FULL, eager),
        StepConfig(FULL, all_idle),
    ]


def run_scenarios(group: DPGroup, steps: list[StepConfig]) -> list[tuple[DPSyncState, BatchExecutionDescriptor]]:
    out = []
    for step in steps:
        batch = step.ranks[group.rank]
        out.append(sync_dp(group, batch.num_reqs, batch.num_tokens, batch.uniform_token_count, step.capture))
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_gloo_sync_matches_in_process_ranks(size: int) -> None:
    steps = scenarios(size)
    expected = run_ranks(lambda g: run_scenarios(g, steps), in_process_world(size, timeout_s=10.0))
    got = run_gloo(size, run_scenarios, steps, timeout_s=10.0)
    assert got == expected
    for step_index in range(len(steps)):
        assert len({rank_results[step_index][0] for rank_results in got}) == 1


def skip_last_sync(group: DPGroup) -> None:
    sync_dp(group, 1, 1, 1, FULL, purpose="target")
    if group.rank != 1:  # rank 1 skips the drafter's sync and stops
        sync_dp(group, 1, 1, 1, FULL, purpose="draft")


def skip_then_continue(group: DPGroup) -> None:
    sync_dp(group, 1, 1, 1, FULL, purpose="target")
    if group.rank != 1:
        sync_dp(group, 1, 1, 1, FULL, purpose="draft")
    sync_dp(group, 1, 1, 1, FULL, purpose="target")


def test_rank_that_skips_a_collective_times_out_not_hangs() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_gloo(2, skip_last_sync, timeout_s=3.0, deadline_s=60.0)
    elapsed = time.monotonic() - start
    assert set(info.value.errors) == {0}
    assert "DPCollectiveTimeout" in str(info.value) and "DP-3" in str(info.value.errors[0])
    assert elapsed < 45, f"a skipped collective took {elapsed:.0f}s to surface"


def test_rank_that_skips_then_continues_is_dp_3() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_gloo(2, skip_then_continue, timeout_s=3.0, contract_mode="shapes")
    first = next(iter(info.value.errors.values()))
    assert getattr(first, "invariant_id", None) == "DP-3", str(info.value)
