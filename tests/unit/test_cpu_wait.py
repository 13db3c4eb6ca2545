"""The share of a timed stretch spent waiting for a CPU: read from Linux's schedstat, unknown elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from busy_host import busy_host

import specdec.cpu_wait as cpu_wait
from specdec.cpu_wait import CpuWait, run_queue_wait_s
from specdec.nn.fp32_kernels import MAX_CPU_WAIT


def _work() -> None:
    a = torch.randn(768, 768, generator=torch.Generator().manual_seed(0))
    for _ in range(60):
        a @ a


@pytest.mark.skipif(run_queue_wait_s() is None, reason="this OS does not report run-queue waits")
def test_a_competing_job_shows_as_waiting() -> None:
    with busy_host(), CpuWait() as busy:
        _work()
    with CpuWait() as quiet:
        _work()
    assert busy.share is not None and quiet.share is not None
    # Beside a job as large as ours the share reads 0.24-0.5; what matters is that the kernel timing's limit sees it.
    assert busy.share > 2 * MAX_CPU_WAIT, busy
    assert quiet.share < busy.share, (quiet, busy)  # not 0: the test's host may run other jobs
    assert busy.wall_s > 0 and quiet.wall_s > 0


def test_without_schedstat_the_share_is_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_wait, "TASKS", tmp_path / "no-such-dir")
    assert run_queue_wait_s() is None
    with CpuWait() as wait:
        _work()
    assert wait.share is None and wait.wall_s > 0


def test_a_schedstat_of_another_layout_is_unknown_not_misread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "schedstat").write_text("123\n")  # one field: no run-queue wait to read
    monkeypatch.setattr(cpu_wait, "TASKS", tmp_path)
    assert run_queue_wait_s() is None
    (tmp_path / "1" / "schedstat").write_text("5 2500000000 7\n")
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "schedstat").write_text("5 500000000 7\n")
    assert run_queue_wait_s() == pytest.approx(3.0)  # nanoseconds, summed over the threads
