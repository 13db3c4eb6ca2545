"""DP faults in-process: every wait is bounded, a stuck rank is named, DP-3 names the diverged rank and purposes,
and timeouts are validated where they enter."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

import contracts
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
from contracts.invariants.dp import diverged_ranks, purpose_tag
from specdec.dispatch import CaptureConfig
from specdec.dp_group import (
    DPCollectiveTimeout,
    DPRankStuck,
    InProcessDPGroup,
    in_process_world,
    init_torch_distributed,
    run_ranks,
    validate_timeout,
)
from specdec.dp_sync import sync_dp
from specdec.engine import EngineConfig
from specdec.nn.config import ModelConfig
from specdec.testing.distributed import exit_description, run_gloo
from specdec.testing.dp_run import DPRunSpec, run_in_process

CFG = CaptureConfig()


def test_a_rank_blocked_outside_a_collective_is_reported_within_the_grace_period() -> None:
    release = threading.Event()

    def step(group: InProcessDPGroup) -> None:
        sync_dp(group, 1, 1, 1, CFG, purpose="target")
        if group.rank == 1:
            release.wait(60)  # local work that never ends; no collective timeout reaches it
            return
        sync_dp(group, 1, 1, 1, CFG, purpose="target")  # times out: rank 1 never joins

    start = time.monotonic()
    try:
        with pytest.raises(DPRankStuck) as info:
            run_ranks(step, in_process_world(2, timeout_s=0.5))
    finally:
        release.set()
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"run_ranks took {elapsed:.1f}s with a 0.5 s timeout"
    message = str(info.value)
    assert "DP rank(s) [1] still running" in message and "rank(s) [0] failed" in message
    assert "rank 1: last running after collective #1 ('dp_sync:target') returned" in message
    assert f"{__file__}:" in message and "in step" in message  # the line the stuck rank is running
    assert isinstance(info.value.__cause__, DPCollectiveTimeout)  # the peer's timeout that started the clock


def test_a_root_cause_wins_over_a_stuck_peer_and_carries_the_stuck_report() -> None:
    release = threading.Event()

    def step(group: InProcessDPGroup) -> None:
        if group.rank == 1:
            release.wait(60)
            return
        raise ValueError("rank 0's own bug")

    try:
        with pytest.raises(ValueError, match="rank 0's own bug") as info:
            run_ranks(step, in_process_world(2, timeout_s=0.3))
    finally:
        release.set()
    assert any("DP rank(s) [1] still running" in note for note in getattr(info.value, "__notes__", []))


def test_ranks_that_finish_at_different_times_are_not_reported_stuck() -> None:
    def step(group: InProcessDPGroup) -> int:
        sync_dp(group, 1, 1, 1, CFG, purpose="target")
        time.sleep(0.6 * group.rank)  # longer than the collective timeout, but no peer failed
        return group.rank

    assert run_ranks(step, in_process_world(3, timeout_s=0.5)) == [0, 1, 2]


@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, 1e-320 * -1, math.nan, math.inf, -math.inf])
def test_timeouts_are_validated_where_they_enter(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be"):
        in_process_world(2, timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be"):
        init_torch_distributed(0, 1, "tcp://127.0.0.1:1", timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be"):
        run_gloo(2, print, timeout_s=bad)  # rejected before any process starts
    with pytest.raises(ValueError, match="deadline_s must be"):
        run_gloo(2, print, deadline_s=bad)
    one_rank = DPRunSpec(ModelConfig.tiny(), 0, EngineConfig(), ((),))
    with pytest.raises(ValueError, match="timeout_s must be"):
        run_in_process(one_rank, timeout_s=bad)
    with pytest.raises(ValueError, match="grace_s must be"):
        run_ranks(lambda g: None, in_process_world(2, timeout_s=1.0), grace_s=bad)


@pytest.mark.parametrize("bad", [0, -3, True, "3", None])
def test_timeouts_that_are_not_positive_numbers_are_rejected_by_the_validator(bad: Any) -> None:
    with pytest.raises(ValueError, match="timeout_s must be"):
        validate_timeout("timeout_s", bad)


def test_valid_timeouts_pass_unchanged() -> None:
    assert validate_timeout("t", 3) == 3.0 and validate_timeout("t", 0.25) == 0.25


def test_dp_3_names_the_rank_that_skipped_and_the_purposes() -> None:
    def step(group: InProcessDPGroup) -> None:
        sync_dp(group, 1, 1, 1, CFG, purpose="target")
        if group.rank == 0:  # rank 0 drafts with its own sync; rank 1 skipped it
            sync_dp(group, 1, 1, 1, CFG, purpose="draft_decode")
        else:  # ... and went on to the next step's target sync, which pairs with rank 0's draft sync
            sync_dp(group, 1, 1, 1, CFG, purpose="target")

    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as info:
        run_ranks(step, in_process_world(2, timeout_s=5.0))
    message = str(info.value)
    assert info.value.invariant_id == "DP-3"
    assert "purpose per rank=['draft_decode', 'target']" in message
    assert "rank 1 synced for 'target' where rank 0 synced for 'draft_decode': it skipped the 'draft_decode' sync" in (
        message
    )


def test_dp_3_names_the_rank_with_fewer_collectives_among_agreeing_peers() -> None:
    t = purpose_tag("target")
    said = diverged_ranks(((5, t), (5, t), (4, t), (5, t)))
    assert said == (
        "rank 2 ran 1 fewer collective(s) than ranks 0, 1, 3 before this sync (skipped one its peers ran), "
        "both at a 'target' sync"
    )
    extra = diverged_ranks(((3, t), (4, purpose_tag("dflash_block")), (3, t)))
    assert extra.startswith("rank 1 ran 1 more collective(s) than ranks 0, 2") and "'dflash_block'" in extra


def test_dp_3_names_a_purpose_this_process_never_synced_for() -> None:
    facts = DPFacts(
        DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 3)),
        BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=3, num_reqs=3),
        0,
        3,
        collective_seqs=((4, purpose_tag("target")), (4, 12345)),
    )
    with pytest.raises(ContractViolation) as info:
        check(Subject.DP, facts, step_kind=StepKind.DP_SYNC, component="test")
    assert "<purpose tag 12345, never synced by this process>" in str(info.value)


def test_dp_3_is_silent_when_every_rank_agrees() -> None:
    def step(group: InProcessDPGroup) -> None:
        for purpose in ("target", "draft_decode", "target"):
            sync_dp(group, 1, 1, 1, CFG, purpose=purpose)

    with contracts.enforce("full"):
        run_ranks(step, in_process_world(3, timeout_s=5.0))


def test_exit_codes_and_signals_are_described() -> None:
    assert exit_description(-9) == "was killed by SIGKILL"
    assert exit_description(-15) == "was killed by SIGTERM"
    assert exit_description(3) == "exited with code 3"
    assert exit_description(None) == "is still running"
