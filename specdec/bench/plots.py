"""The bench's PNG plots, drawn from the JSON report: speedup per backend per suite, acceptance by position.

matplotlib (the ``bench`` extra) is imported only here and only with the
non-interactive Agg backend, so the bench runs headless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.bench.runner import PLAIN

SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance.png"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the bench's plots need matplotlib: pip install 'specdec[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _configs(summaries: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return sorted({(s["batch_size"], s["temperature"]) for s in summaries})


def plot_speedup(report: dict[str, Any], path: Path) -> Path:
    """One panel per (batch size, temperature): per suite, a bar per backend at its median speedup (range as error)."""
    plt = _pyplot()
    summaries = report["summaries"]
    backends = [b for b in report["config"]["backends"]]
    suites = [s for s in report["config"]["suites"] if any(x["suite"] == s for x in summaries)]
    configs = _configs(summaries)
    cols = min(2, max(1, len(configs)))
    rows = -(-len(configs) // cols) if configs else 1
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    width = 0.8 / max(1, len(backends))
    for ax, (size, temp) in zip(axes.flat, configs, strict=False):
        for j, backend in enumerate(backends):
            xs, ys, lo, hi = [], [], [], []
            for i, suite in enumerate(suites):
                match = [
                    s
                    for s in summaries
                    if (s["suite"], s["batch_size"], s["temperature"], s["runner"]) == (suite, size, temp, backend)
                    and s["speedup"]
                ]
                if match:
                    sp = match[0]["speedup"]
                    xs.append(i + (j - (len(backends) - 1) / 2) * width)
                    ys.append(sp["median"])
                    lo.append(sp["median"] - sp["low"])
                    hi.append(sp["high"] - sp["median"])
            if xs:
                bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=backend)
                ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=2)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(suites)), suites)
        ax.set_ylabel(f"speedup over {PLAIN} (x)")
        ax.set_title(f"batch {size}, {'greedy' if temp == 0 else f'temperature {temp:g}'}")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(configs) :]:
        ax.set_visible(False)
    fig.suptitle(f"{report['environment']['model']}, K={report['config']['k']}: median of interleaved pairs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(report: dict[str, Any], path: Path) -> Path:
    """One panel per suite: each backend's acceptance rate by draft position, batch 1, greedy (else the first config)."""
    plt = _pyplot()
    summaries = [s for s in report["summaries"] if s["acceptance_by_position"]]
    suites = [s for s in report["config"]["suites"] if any(x["suite"] == s for x in summaries)]
    fig, axes = plt.subplots(1, max(1, len(suites)), figsize=(4.5 * max(1, len(suites)), 3.6), squeeze=False)
    for ax, suite in zip(axes.flat, suites, strict=False):
        mine = [s for s in summaries if s["suite"] == suite]
        configs = _configs(mine)
        size, temp = (1, 0.0) if (1, 0.0) in configs else configs[0]
        for s in mine:
            if (s["batch_size"], s["temperature"]) == (size, temp):
                rates = s["acceptance_by_position"]
                label = s["runner"] if s["tau"] is None else f"{s['runner']} (tau {s['tau']:.2f})"
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        ax.set_ylim(0, 1.02)
        ax.set_xticks(range(1, max((len(s["acceptance_by_position"]) for s in mine), default=1) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_title(f"{suite}: batch {size}, {'greedy' if temp == 0 else f'T={temp:g}'}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Both plots into ``out_dir``; their file names."""
    plot_speedup(report, out_dir / SPEEDUP_PNG)
    plot_acceptance(report, out_dir / ACCEPTANCE_PNG)
    return [SPEEDUP_PNG, ACCEPTANCE_PNG]
