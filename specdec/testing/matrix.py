"""``specdec matrix``: the conformance suite for chosen backends, as a table, JSON and JUnit XML.

A benchmark-style command (it prints counts and times), not a test: the
count of generated configurations per backend and the time they took are the
figures the project tracks.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from queue import Empty
from typing import Any
from xml.etree import ElementTree

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec.backend_registry import available_backends, factory_for, names_option
from specdec.testing.conformance import (
    FAMILIES,
    TENSOR_MODES,
    ConformanceReport,
    FamilyResult,
    run_family,
)
from specdec.testing.dp_run import reference_cache, set_reference_cache

BUILT_IN = ("eagle", "draft-model", "dflash", "dspark")


_progress: Any = None
"""A worker's end of the progress queue (set by ``_init_worker``)."""


def _init_worker(queue: Any) -> None:
    """A worker process: one intra-op thread, plain references shared by all the cells it runs, the progress queue.

    The queue comes with the process (a plain multiprocessing queue, no manager process to serve it).
    """
    import torch

    global _progress
    torch.set_num_threads(1)  # tiny models: under load, a second intra-op thread makes an op 10-80x slower
    set_reference_cache(True)
    _progress = queue


def _run_cell(backend: str, family: str, mode: str, examples: int, seed: int, example: int | None) -> FamilyResult:
    """One (backend, family, tensor mode) cell in a worker process; progress goes back through the queue."""
    key = (backend, family, mode)
    last = [0.0]

    def report(r: FamilyResult) -> None:
        now = time.perf_counter()
        if now - last[0] >= 1.0 and _progress is not None:  # progress is IPC: at most once a second per worker
            last[0] = now
            _progress.put((key, r.examples))

    return run_family(
        factory_for(backend),
        family,
        examples=examples,
        tensor_mode=mode,
        seed=seed,
        on_example=report,
        example=example,
        backend=backend,
    )


def run_matrix(
    backends: Sequence[str],
    *,
    families: Sequence[str],
    examples: int,
    tensor_modes: Sequence[str],
    seed: int,
    console: Console,
    workers: int,
    example: int | None = None,
) -> list[tuple[ConformanceReport, float]]:
    """Every (backend, tensor mode, family) cell, cells of one backend spread over ``workers`` processes.

    Rank threads of one run share the GIL, so processes are what use a
    second core; each backend's wall time is measured over its own cells.
    ``example`` runs only that generated example of each cell (a failure's repro).
    """
    if workers <= 1:
        return _run_matrix_here(
            backends, families=families, examples=examples, tensor_modes=tensor_modes, seed=seed, example=example
        )
    reports: list[tuple[ConformanceReport, float]] = []
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with (
        ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(queue,)
        ) as pool,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            refresh_per_second=2,  # the parent shares the cores with the workers
        ) as progress,
    ):
        for backend in backends:
            factory = factory_for(backend)
            cells = _cells(factory, families, tensor_modes)
            task = progress.add_task(f"{backend} ({workers} workers)", total=examples * len(cells))
            done: dict[tuple[str, str, str], int] = {}
            start = time.perf_counter()
            # The longest cells first (fake-cuda replays, then many-rank families), so no worker idles at the end.
            order = sorted(cells, key=lambda c: (c[1] != "fake-cuda", c[0] not in _SLOW))
            futures = [pool.submit(_run_cell, backend, f, m, examples, seed, example) for f, m in order]
            pending = set(futures)
            while pending:
                # Only the unfinished ones: waiting on a finished future returns at once (a busy loop on a core).
                pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED).not_done
                with contextlib.suppress(Empty):
                    while True:
                        key, count = queue.get_nowait()
                        done[key] = count
                progress.update(task, completed=sum(done.values()))
            by_cell = {(r.family, r.tensor_mode): r for r in (f.result() for f in futures)}
            results = [by_cell[c] for c in cells]
            reports.append((ConformanceReport(backend, results), time.perf_counter() - start))
    return reports


def _run_matrix_here(
    backends: Sequence[str],
    *,
    families: Sequence[str],
    examples: int,
    tensor_modes: Sequence[str],
    seed: int,
    example: int | None = None,
) -> list[tuple[ConformanceReport, float]]:
    """The one-worker matrix, in this process (no pool to start: tests and debugging)."""
    import torch

    reports = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a worker process
    try:
        with reference_cache():
            for backend in backends:
                factory = factory_for(backend)
                start = time.perf_counter()
                results = [
                    run_family(
                        factory,
                        family,
                        examples=examples,
                        tensor_mode=mode,
                        seed=seed,
                        example=example,
                        backend=backend,
                    )
                    for family, mode in _cells(factory, families, tensor_modes)
                ]
                reports.append((ConformanceReport(backend, results), time.perf_counter() - start))
    finally:
        torch.set_num_threads(threads)
    return reports


_SLOW = ("dp", "draft-length", "chunked-prefill")
"""Families whose examples run the most rank engines or draft steps."""


def _cells(factory: Any, families: Sequence[str], tensor_modes: Sequence[str]) -> list[tuple[str, str]]:
    """A backend's (family, tensor mode) cells in report order; ``capacity`` only where it is an option."""
    return [
        (family, mode)
        for mode in tensor_modes
        for family in families
        if family != "capacity" or names_option(factory, "capacity")
    ]


def render(reports: Sequence[tuple[ConformanceReport, float]], families: Sequence[str]) -> Table:
    table = Table(title="specdec conformance matrix (generated configurations per cell)")
    table.add_column("backend")
    for family in families:
        table.add_column(family, overflow="fold")
    table.add_column("examples", justify="right")
    table.add_column("seconds", justify="right")
    for report, seconds in reports:
        cells = []
        for family in families:
            cell = []
            for r in report.results:
                if r.family != family:
                    continue
                if r.skipped:
                    cell.append(f"[dim]{r.tensor_mode}: skipped[/dim]")
                elif r.passed:
                    cell.append(f"[green]{r.tensor_mode}: {r.examples} ok[/green]")
                else:
                    ids = ", ".join(sorted(set(r.caught_by)))
                    cell.append(f"[red]{r.tensor_mode}: {r.failures}/{r.examples} failed ({ids})[/red]")
            cells.append("\n".join(cell) or "[dim]n/a[/dim]")
        table.add_row(report.backend, *cells, str(report.examples), f"{seconds:.1f}")
    return table


def axes_table(report: ConformanceReport) -> Table:
    """What each family of a backend reached, per tensor mode: the evidence behind a pass (``axes``)."""
    table = Table(title=f"{report.backend}: axes reached (a full cycle of examples must reach every named value)")
    table.add_column("family")
    table.add_column("mode")
    table.add_column("axes reached", overflow="fold")
    table.add_column("never reached", overflow="fold")
    for r in report.results:
        if r.skipped:
            continue
        reached = "; ".join(f"{axis}={values}" for axis, values in r.axes_reached.items())
        if r.axes_missing:
            missing = "[red]" + "; ".join(f"{axis}={values}" for axis, values in r.axes_missing.items()) + "[/red]"
        else:
            missing = "-" if r.axes_judged else f"[dim]not judged: {r.examples} examples, under a full cycle[/dim]"
        table.add_row(r.family, r.tensor_mode, reached, missing)
    return table


def junit_xml(reports: Sequence[tuple[ConformanceReport, float]]) -> str:
    """One testsuite per backend, one testcase per (family, tensor mode)."""
    root = ElementTree.Element("testsuites", name="specdec matrix")
    for report, seconds in reports:
        failures = sum(1 for r in report.results if not r.passed and not r.skipped)
        skipped = sum(1 for r in report.results if r.skipped)
        suite = ElementTree.SubElement(
            root,
            "testsuite",
            name=report.backend,
            tests=str(len(report.results)),
            failures=str(failures),
            skipped=str(skipped),
            time=f"{seconds:.3f}",
        )
        for r in report.results:
            case = ElementTree.SubElement(
                suite,
                "testcase",
                classname=f"specdec.testing.matrix.{report.backend}",
                name=f"{r.family}[{r.tensor_mode}]",
                time=f"{r.seconds:.3f}",
            )
            checked = sum(r.draft_forward_evaluations.values())
            ElementTree.SubElement(case, "properties").extend(
                [
                    ElementTree.Element("property", name="examples", value=str(r.examples)),
                    ElementTree.Element("property", name="draft_forward_evaluations", value=str(checked)),
                    ElementTree.Element("property", name="axes_reached", value=json.dumps(r.axes_reached)),
                ]
            )
            if r.skipped:
                ElementTree.SubElement(case, "skipped", message=r.skipped)
            elif not r.passed:
                failure = ElementTree.SubElement(
                    case, "failure", message=f"{r.failures}/{r.examples} failed: {sorted(set(r.caught_by))}"
                )
                failure.text = f"{r.first_failure}\nreproduce: {r.repro}" if r.repro else r.first_failure
    return ElementTree.tostring(root, encoding="unicode")


def main(
    backends: Sequence[str] | None,
    *,
    families: Sequence[str] | None = None,
    examples: int = 167,
    tensor_modes: Sequence[str] = TENSOR_MODES,
    seed: int = 0,
    json_path: str | None = None,
    junit_path: str | None = None,
    workers: int | None = None,
    example: int | None = None,
) -> int:
    console = Console(width=max(Console().width, 140))  # tables stay readable in logs (no tty: 80 columns)
    chosen = list(backends) if backends else [b for b in BUILT_IN if b in available_backends()]
    fams = list(families) if families else list(FAMILIES)
    unknown = [f for f in fams if f not in FAMILIES] + [m for m in tensor_modes if m not in TENSOR_MODES]
    if unknown:
        console.print(
            f"[red]unknown families or tensor modes {unknown}; families {sorted(FAMILIES)}, modes {TENSOR_MODES}"
        )
        return 2
    if examples < 1 or (workers is not None and workers < 1) or (example is not None and example < 1):
        console.print(
            f"[red]--examples, --example and --workers must be at least 1 (got {examples}, {example} and {workers})"
        )
        return 2
    examples = example or examples
    workers = workers or os.cpu_count() or 1
    reports = run_matrix(
        chosen,
        families=fams,
        examples=examples,
        tensor_modes=tensor_modes,
        seed=seed,
        console=console,
        workers=workers,
        example=example,
    )
    console.print(render(reports, fams))
    for report, seconds in reports:
        rate = report.examples / seconds if seconds else 0.0
        cpu = sum(r.cpu_seconds for r in report.results)
        console.print(
            f"{report.backend}: {report.examples} generated configurations in {seconds:.1f} s "
            f"({rate:.1f}/s with {workers} worker{'s' if workers > 1 else ''}; {cpu:.0f} CPU-s, "
            f"{report.examples / cpu if cpu else 0.0:.1f} per CPU-second); "
            f"{'all passed' if report.ok else 'FAILED: ' + ', '.join(report.violated)}"
        )
        for r in report.results:
            if r.first_failure:
                at = f"example {r.first_failure_example}" if r.first_failure_example is not None else "whole family"
                console.print(f"  [red]{r.family}[{r.tensor_mode}][/red] first failure ({at}): {r.first_failure}")
                console.print(f"    reproduce: {r.repro}", markup=False, highlight=False, soft_wrap=True)
        console.print(axes_table(report))
    payload: dict[str, Any] = {
        "seed": seed,
        "example": example,
        "examples_per_family": examples,
        "workers": workers,
        "backends": [report.as_dict() | {"seconds": seconds} for report, seconds in reports],
    }
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=2), encoding="utf-8")
        console.print(f"wrote {json_path}")
    if junit_path:
        Path(junit_path).write_text(junit_xml(reports), encoding="utf-8")
        console.print(f"wrote {junit_path}")
    return 0 if all(report.ok for report, _ in reports) else 1
