"""How much of a timed stretch this process's threads spent ready to run but waiting for a CPU.

A timing taken while another process competes for the cores says little
about the host: on two cores shared with another two-thread job, oneDNN's
packed fp32 products of one row took 40x their quiet time and MKL's ``F.linear``
1.15x, so a choice timed then picked the kernel that is 1.8x slower on a
quiet host, and ``load`` kept it for every later process (measured on an AMD
EPYC with 2 cores). Linux counts, per thread, the time spent runnable on a run
queue without a CPU (``/proc/self/task/*/schedstat``, second field, in ns):
that is the contention itself, not a guess from wall times.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TASKS = Path("/proc/self/task")


def run_queue_wait_s() -> float | None:
    """Seconds this process's threads have waited on a run queue, summed; None where the OS does not say."""
    total = 0
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    seen = False
    for tid in tids:
        try:
            fields = (TASKS / tid / "schedstat").read_text().split()
        except OSError:  # a thread that ended since the listing
            continue
        if len(fields) < 2:
            return None
        total += int(fields[1])
        seen = True
    return total / 1e9 if seen else None


@dataclass
class CpuWait:
    """A stretch of wall time and the share of its thread-time spent waiting for a CPU (``None``: not known).

    The share is the run-queue wait over wall time times torch's thread count:
    0.0 on an idle host, about 0.5 where another job keeps as many threads busy.
    """

    wall_s: float = 0.0
    share: float | None = None
    _start: float = 0.0
    _wait: float | None = None

    def __enter__(self) -> CpuWait:
        self._wait = run_queue_wait_s()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._start
        after = run_queue_wait_s()
        if self._wait is None or after is None or self.wall_s <= 0:
            self.share = None
        else:
            self.share = max(0.0, after - self._wait) / (self.wall_s * torch.get_num_threads())
