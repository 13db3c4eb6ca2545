"""Where ``specdec bench`` writes: ``bench.json``, ``bench.md`` and plots, and the generated part of the docs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdec.bench.report import render_markdown

DOCS_PATH = "docs/benchmarks.md"
DOCS_BEGIN = "<!-- bench:begin (written by `specdec bench --write-docs`; do not edit by hand) -->"
DOCS_END = "<!-- bench:end -->"

# -- outputs -----------------------------------------------------------------------------------------------------


def write_outputs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``bench.json``, the PNG plots and ``bench.md`` (which links the plots) into ``out_dir``."""
    from specdec.bench.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        report["plots"] = write_plots(report, out_dir)
    except ImportError as exc:  # matplotlib is the bench extra's; the tables do not need it
        report["plots"] = []
        report["plots_skipped"] = str(exc)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out_dir / "bench.md").write_text(render_markdown(report), encoding="utf-8")
    return [out_dir / "bench.json", out_dir / "bench.md", *(out_dir / p for p in report["plots"])]


def check_docs(doc: Path) -> str:
    """``doc``'s text, once it is known to hold a generated section: checked before a run, not after it."""
    try:
        text = doc.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {doc}: {exc.strerror}") from None
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{doc} has no generated section ({DOCS_BEGIN!r} ... {DOCS_END!r})")
    return text


def write_docs(report: dict[str, Any], out_dir: Path, doc: Path) -> None:
    """Replace the generated section of ``doc`` with this report and copy the plots beside it."""
    text = check_docs(doc)
    images = doc.parent / "benchmarks"
    images.mkdir(exist_ok=True)
    for plot in report.get("plots", []):
        shutil.copyfile(out_dir / plot, images / plot)
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    body = render_markdown(report, image_dir="benchmarks")
    doc.write_text(f"{head}{DOCS_BEGIN}\n\n{body}\n{DOCS_END}{tail}", encoding="utf-8")
