"""Gloo ranks that die or hang are reported by number and cause within the collective timeout, not the deadline.

Each test bounds itself: it measures its own time and asserts it stayed well under ``run_gloo``'s 120 s deadline
(spawning two ranks that import torch takes 10-20 s on a loaded two-core machine).
"""

from __future__ import annotations

import time

import pytest
from gloo_faults import exit_silently, hang_outside_a_collective, kill_self, ok

from specdec.dp_group import DPCollectiveTimeout
from specdec.testing.distributed import DistributedRunError, RankDied, run_gloo

BOUND_S = 90.0
"""Well under the 120 s deadline that a dead rank used to cost; generous for process start-up on a loaded machine."""


def test_a_rank_killed_by_sigkill_is_named_with_its_signal_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_gloo(2, kill_self, timeout_s=5.0)
    elapsed = time.monotonic() - start
    assert isinstance(info.value.errors[1], RankDied)
    assert "rank 1 was killed by SIGKILL" in str(info.value)
    assert next(iter(info.value.errors)) == 1  # the dead rank is the root cause, listed before its peer's failure
    assert elapsed < BOUND_S, f"a killed rank took {elapsed:.0f}s to surface"


def test_a_rank_that_exits_without_reporting_is_named_with_its_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_gloo(2, exit_silently, timeout_s=5.0)
    assert "rank 1 exited with code 3 before reporting a result" in str(info.value)
    assert time.monotonic() - start < BOUND_S


def test_a_rank_hanging_outside_a_collective_is_killed_after_the_timeout_and_margin() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_gloo(2, hang_outside_a_collective, timeout_s=3.0)
    elapsed = time.monotonic() - start
    assert isinstance(info.value.errors[0], DPCollectiveTimeout)
    assert "rank 1 reported nothing 13s after rank(s) [0] failed" in str(info.value.errors[1])
    assert elapsed < BOUND_S + 13, f"a hanging rank took {elapsed:.0f}s to surface"


def test_healthy_ranks_report_their_results() -> None:
    assert run_gloo(2, ok, timeout_s=5.0) == [0, 1]
