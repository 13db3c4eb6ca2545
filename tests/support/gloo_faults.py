"""Rank functions for the gloo fault tests: module-level, so spawned processes can unpickle them."""

from __future__ import annotations

import os
import signal
import time

from specdec.dispatch import CaptureConfig
from specdec.dp_group import DPGroup
from specdec.dp_sync import sync_dp

CONFIG = CaptureConfig()


def ok(group: DPGroup) -> int:
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")
    return group.rank


def kill_self(group: DPGroup) -> None:
    """Rank 1 dies by SIGKILL after the first sync, as the OOM killer would end it; rank 0 syncs on."""
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")


def exit_silently(group: DPGroup) -> None:
    """Rank 1's interpreter ends with code 3 without reporting (``os._exit`` skips every handler)."""
    if group.rank == 1:
        os._exit(3)
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")


def hang_outside_a_collective(group: DPGroup) -> None:
    """Rank 1 blocks in local work after the first sync; rank 0's next sync times out."""
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")
    if group.rank == 1:
        time.sleep(3600)
    sync_dp(group, 1, 1, 1, CONFIG, purpose="target")
