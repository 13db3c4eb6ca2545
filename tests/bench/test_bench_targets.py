"""The bench's targets, judged from a report's plain data: each holds, misses, or cannot be measured.

The figures are made up and chosen to sit on each target's edge, so a rule
that is off by its boundary (``>`` for ``>=``, the noise ignored or applied
twice, a tie counted as a bug or a bug as a tie) fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

from specdec.bench.report import evaluate_targets, every_cell_target, lossless_target, render_markdown

BACKENDS = ["eagle", "dflash", "dspark"]


def cell(suite: str, batch: int, temp: float, runner: str, median: float | None, tau: float | None = None) -> dict:
    return {
        "suite": suite,
        "batch_size": batch,
        "temperature": temp,
        "runner": runner,
        "tau": tau,
        "speedup": None if median is None else {"median": median, "low": median, "high": median, "n": 4},
    }


def grid(medians: dict[tuple[str, int, float, str], float]) -> list[dict]:
    """Every backend at 1.10x in every cell of two suites, batches 1 and 8, T = 0 and 1, except ``medians``."""
    out = []
    for suite in ("humaneval", "mtbench"):
        for batch in (1, 8):
            for temp in (0.0, 1.0):
                out.append(cell(suite, batch, temp, "plain", None))
                out += [
                    cell(suite, batch, temp, b, medians.get((suite, batch, temp, b), 1.10), tau=2.0) for b in BACKENDS
                ]
    return out


def by_name(targets: list[Any], prefix: str) -> Any:
    (found,) = [t for t in targets if t.name.startswith(prefix)]
    return found


def test_every_cell_holds_within_the_noise_and_misses_beyond_it() -> None:
    summaries = grid({("mtbench", 8, 1.0, "dflash"): 0.99, ("humaneval", 8, 0.0, "eagle"): 0.986})
    held = every_cell_target(summaries, BACKENDS, noise=0.015)
    assert held.passed is True
    assert held.value == "2 of 24 cells below 1.0x, 0 beyond the noise 1.5%; lowest humaneval b8 T=0 eagle 0.986x"
    assert held.note == ""
    missed = every_cell_target(summaries, BACKENDS, noise=0.012)
    assert missed.passed is False
    assert missed.value.startswith("2 of 24 cells below 1.0x, 1 beyond the noise 1.2%")
    assert missed.note == "beyond the noise: humaneval b8 T=0: eagle 0.986x"
    on_the_edge = every_cell_target(grid({("mtbench", 8, 1.0, "dflash"): 0.875}), BACKENDS, noise=0.125)
    assert on_the_edge.passed is True and on_the_edge.note == ""  # 1 - noise itself is within the noise


def test_every_cell_allows_nothing_without_a_noise_figure_and_counts_only_backends() -> None:
    summaries = [*grid({("mtbench", 1, 1.0, "dspark"): 0.999}), cell("mtbench", 1, 0.0, "transformers", 0.7)]
    target = every_cell_target(summaries, BACKENDS, noise=None)
    assert target.passed is False and "beyond no noise figure" in target.value
    assert target.note == "beyond the noise: mtbench b1 T=1: dspark 0.999x"
    exact = every_cell_target(grid({("mtbench", 1, 1.0, "dspark"): 1.0}), BACKENDS, noise=None)
    assert exact.passed is True and exact.value.startswith("0 of 24 cells below 1.0x")
    assert every_cell_target([cell("s", 1, 0.0, "plain", None)], BACKENDS, noise=0.01).passed is None


def lossless(mismatches: list[dict], batching: list[dict] | None = None) -> dict:
    return {
        "compared": {"eagle": 10, "dflash": 10},
        "identical": {"eagle": 10, "dflash": 10 - len(mismatches)},
        "mismatches": mismatches,
        "batching": {"compared": 4, "identical": 4 - len(batching or [])},
        "batching_mismatches": batching or [],
    }


@pytest.mark.parametrize(
    ("verdicts", "batching", "passed"),
    [
        ([], [], True),
        (["tie: plain's top-1 and top-2 within tolerance"], [], True),
        (["NOT a tie: a losslessness bug"], [], False),
        ([], ["NOT a tie: a losslessness bug"], False),
        (["tie: plain's top-1 and top-2 within tolerance"], ["tie: within tolerance"], True),
    ],
)
def test_lossless_passes_ties_and_fails_anything_else(verdicts: list[str], batching: list[str], passed: bool) -> None:
    data = lossless([{"verdict": v} for v in verdicts], [{"verdict": v} for v in batching])
    target = lossless_target(data)
    assert target.passed is passed
    wrong = sum("NOT" in v for v in verdicts + batching)
    assert target.value.endswith(f"{len(verdicts) + len(batching)} mismatch(es), {wrong} not a tie")
    assert lossless_target({}).passed is None


def report(peer_ratio: float | None, speeds: dict[str, float], noise: float = 0.01) -> dict:
    summaries = grid({("humaneval", 1, 0.0, b): s for b, s in speeds.items()})
    peer: dict[str, Any] = {"status": "skipped", "reason": "--no-peer"}
    if peer_ratio is not None:
        peer = {
            "status": "ok",
            "engine_over_transformers": {"median": peer_ratio, "low": 1.0, "high": 1.5, "n": 96},
            "prompt_lookup": {"speedup_over_transformers": {"median": 1.39, "low": 1.0, "high": 4.0, "n": 96}},
        }
    return {
        "config": {"backends": BACKENDS, "k": 4},
        "summaries": summaries,
        "noise": noise,
        "lossless": lossless([]),
        "peer": peer,
        "contracts": {},
    }


def test_the_speed_and_peer_targets_have_inclusive_edges() -> None:
    at_edges = evaluate_targets(report(1.30, {"eagle": 1.30, "dflash": 2.0, "dspark": 1.5}))
    assert by_name(at_edges, "best backend >= 2.0x").passed is True
    assert by_name(at_edges, "best backend >= 2.0x").value == "dflash 2.00x"
    assert by_name(at_edges, "every backend >= 1.3x").passed is True
    peer = by_name(at_edges, "engine plain >= 1.3x transformers")
    assert peer.passed is True and peer.note == "transformers' prompt lookup: 1.39x its own generate"
    below = evaluate_targets(report(1.29, {"eagle": 1.29, "dflash": 1.99, "dspark": 1.5}))
    assert by_name(below, "best backend >= 2.0x").passed is False
    assert by_name(below, "every backend >= 1.3x").passed is False
    assert by_name(below, "engine plain >= 1.3x transformers").passed is False
    unmeasured = evaluate_targets(report(None, {}))
    assert by_name(unmeasured, "engine plain >= 1.3x transformers").value == "--no-peer"


def test_the_targets_table_renders_every_target_with_its_verdict() -> None:
    data = report(1.31, {"eagle": 1.4, "dflash": 2.1, "dspark": 1.9}, noise=0.01)
    data["summaries"][-1]["speedup"]["median"] = 0.95  # mtbench b8 T=1 dspark
    targets = evaluate_targets(data)
    lines = [line for line in _render(data, targets).split("\n") if line.startswith("| ") and "target" not in line]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in lines[: len(targets)]}
    assert rows == {
        "best backend >= 2.0x plain (batch 1, greedy, HumanEval)": "yes",
        "every backend >= 1.3x plain (batch 1, greedy, HumanEval)": "yes",
        "every backend >= 1.0x plain in every cell (within the noise)": "**no**",
        "greedy output equals plain decoding (ties explained)": "yes",
        "engine plain >= 1.3x transformers generate": "yes",
        "dspark tau > dflash tau > eagle tau (batch 1, greedy, HumanEval)": "**no**",
    }
    assert "beyond the noise: mtbench b8 T=1: dspark 0.950x" in _render(data, targets)


def _render(data: dict, targets: list[Any]) -> str:
    full = {
        **data,
        "command": "specdec bench",
        "created_utc": "2026-12-06 00:00 UTC",
        "environment": {
            "platform": "p",
            "cpu_count": 2,
            "torch": "t",
            "threads": 2,
            "model": "m",
            "dtype": "bfloat16",
            "contracts": "off",
        },
        "config": {**data["config"], "max_tokens": 64, "repeats": 2, "suites": []},
        "peer": {"status": "skipped", "reason": "judged already"},  # the targets are given; the section is not read
        "targets": [t.as_dict() for t in targets],
    }
    return render_markdown(full)
