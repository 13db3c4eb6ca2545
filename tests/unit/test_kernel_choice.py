"""The fp32 kernel choice is timed once per host, torch, thread count and model shape, then read from the home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from packed_models import MEDIUM

import specdec.hub.kernel_choice as kernel_choice
from specdec.hub.kernel_choice import CHOICE_FILE, choose_fp32_kernels_once, host_key
from specdec.nn.fp32_kernels import KernelTiming, product_shapes, timed_products
from specdec.nn.packed_linear import fp32_f_linear_rows, mkldnn_available, set_fp32_f_linear_rows
from specdec.nn.transformer import Transformer

pytestmark = [
    pytest.mark.skipif(not mkldnn_available(), reason="this torch build has no oneDNN: nothing is packed"),
    pytest.mark.usefixtures("restore_choice"),  # the choice is process-wide
]


@pytest.fixture
def timings(monkeypatch: pytest.MonkeyPatch) -> list[Transformer]:
    """Stands in for the timing: F.linear wins at 1 and 2 rows; each call is recorded."""
    calls: list[Transformer] = []

    def fake(model: Transformer) -> list[KernelTiming]:
        calls.append(model)
        set_fp32_f_linear_rows(frozenset({1, 2}))
        return [
            KernelTiming(1, 1.0, 0.7),
            KernelTiming(2, 1.0, 0.8),
            KernelTiming(3, 1.0, 1.2),
            KernelTiming(4, 1.0, 1.3),
        ]

    monkeypatch.setattr(kernel_choice, "choose_fp32_kernels", fake)
    return calls


def test_the_first_load_times_and_records_and_the_next_reads_the_record(
    medium: Transformer, timings: list[Transformer], tmp_path: Path
) -> None:
    assert choose_fp32_kernels_once(medium, tmp_path) == {1, 2}
    assert len(timings) == 1
    record = json.loads((tmp_path / CHOICE_FILE).read_text())
    (entry,) = record["hosts"].values()
    assert entry["f_linear_rows"] == [1, 2] and [t["rows"] for t in entry["timings_ms"]] == [1, 2, 3, 4]

    set_fp32_f_linear_rows(frozenset())
    assert choose_fp32_kernels_once(medium, tmp_path) == {1, 2}
    assert len(timings) == 1  # read, not timed
    assert fp32_f_linear_rows() == {1, 2}  # and applied process-wide, as a timing would


def test_another_thread_count_or_model_shape_is_timed_anew_and_kept_beside(
    medium: Transformer, timings: list[Transformer], tmp_path: Path
) -> None:
    choose_fp32_kernels_once(medium, tmp_path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        choose_fp32_kernels_once(medium, tmp_path)
    finally:
        torch.set_num_threads(threads)
    wider = Transformer(MEDIUM.model_copy(update={"intermediate_size": 768}), seed=0)
    choose_fp32_kernels_once(wider, tmp_path)
    assert len(timings) == 3
    assert len(json.loads((tmp_path / CHOICE_FILE).read_text())["hosts"]) == 3
    choose_fp32_kernels_once(wider, tmp_path)
    assert len(timings) == 3


@pytest.mark.parametrize(
    "content",
    [
        "not json {",
        json.dumps([1, 2]),
        json.dumps({"format": 99, "hosts": {}}),
        "BAD-ROWS",  # the right key, rows that are not row counts
    ],
)
def test_a_record_that_cannot_be_used_is_timed_over_and_rewritten(
    medium: Transformer, timings: list[Transformer], tmp_path: Path, content: str
) -> None:
    if content == "BAD-ROWS":
        choose_fp32_kernels_once(medium, tmp_path)
        record = json.loads((tmp_path / CHOICE_FILE).read_text())
        for entry in record["hosts"].values():
            entry["f_linear_rows"] = ["1", 0]
        content = json.dumps(record)
        timings.clear()
    (tmp_path / CHOICE_FILE).write_text(content)
    assert choose_fp32_kernels_once(medium, tmp_path) == {1, 2}
    assert len(timings) == 1
    (entry,) = json.loads((tmp_path / CHOICE_FILE).read_text())["hosts"].values()
    assert entry["f_linear_rows"] == [1, 2]


def test_a_home_that_cannot_be_written_costs_only_the_timing(
    medium: Transformer, timings: list[Transformer], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.write_text("a file where the home directory should be")
    assert choose_fp32_kernels_once(medium, home) == {1, 2}
    assert choose_fp32_kernels_once(medium, home) == {1, 2}
    assert len(timings) == 2


def test_a_choice_timed_on_a_busy_host_is_used_but_not_kept(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[Transformer] = []

    def busy(model: Transformer) -> list[KernelTiming]:
        calls.append(model)
        set_fp32_f_linear_rows(frozenset())
        return [KernelTiming(1, 1.0, 0.5, cpu_wait=0.4), KernelTiming(2, 1.0, 1.5, cpu_wait=0.0)]

    monkeypatch.setattr(kernel_choice, "choose_fp32_kernels", busy)
    assert choose_fp32_kernels_once(medium, tmp_path) == frozenset()
    assert not (tmp_path / CHOICE_FILE).exists()
    assert choose_fp32_kernels_once(medium, tmp_path) == frozenset()
    assert len(calls) == 2  # timed again, since nothing was kept


def test_the_wait_is_kept_with_the_timings(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def quiet(model: Transformer) -> list[KernelTiming]:
        set_fp32_f_linear_rows(frozenset({1}))
        return [KernelTiming(1, 1.0, 0.5, cpu_wait=0.012345), KernelTiming(2, 1.0, 1.5), KernelTiming(3, 1.0, 1.5)]

    monkeypatch.setattr(kernel_choice, "choose_fp32_kernels", quiet)
    assert choose_fp32_kernels_once(medium, tmp_path) == {1}
    (entry,) = json.loads((tmp_path / CHOICE_FILE).read_text())["hosts"].values()
    assert [t["cpu_wait"] for t in entry["timings_ms"]] == [0.0123, None, None]


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_record_is_timed_over(
    medium: Transformer, timings: list[Transformer], tmp_path: Path, version: int
) -> None:
    """Format 1 kept timings without checking the host was quiet (one such record held a 1.8x slower kernel);
    format 2 ones have no prefill's timing, so their choice says nothing about prefills."""
    key = host_key(product_shapes(timed_products(medium)))
    old = {"format": version, "hosts": {key: {"f_linear_rows": [3], "timings_ms": [], "measured_utc": "then"}}}
    (tmp_path / CHOICE_FILE).write_text(json.dumps(old))
    assert choose_fp32_kernels_once(medium, tmp_path) == {1, 2}
    assert len(timings) == 1
    record = json.loads((tmp_path / CHOICE_FILE).read_text())
    assert record["format"] == kernel_choice.FORMAT == 3 and record["hosts"][key]["f_linear_rows"] == [1, 2]


def test_nothing_to_choose_reads_and_writes_nothing(timings: list[Transformer], tmp_path: Path) -> None:
    assert choose_fp32_kernels_once(Transformer(MEDIUM, seed=0, dtype=torch.bfloat16), tmp_path) is None
    assert timings == [] and not (tmp_path / CHOICE_FILE).exists()
