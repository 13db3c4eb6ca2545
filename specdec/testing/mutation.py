"""Score the contracts against the mutation corpus: does the conformance matrix catch each known bug, and how?

Each mutant runs against its backend's configuration family through
``run_family(..., stop_at_first_failure=True)`` with contracts in ``full``
mode (the plain reference run included, so a bug in shared target code is
judged by the same contracts). The same families without any mutant must pass
first: a failing baseline means a finding is not the mutant's, and the score
is void.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import contracts
from contracts import ContractViolation
from specdec.backend_registry import factory_for
from specdec.dp_group import DPCollectiveTimeout
from specdec.testing.conformance import FamilyResult, run_family
from specdec.testing.corpus import get
from specdec.testing.mutant import Mutant

INVARIANT_ID = re.compile(r"^[A-Z]+-\d+$")
DEFAULT_EXAMPLES = 25


def is_invariant(caught_by: str | None) -> bool:
    return caught_by is not None and INVARIANT_ID.match(caught_by) is not None


@dataclass
class MutantResult:
    name: str
    backend: str
    family: str
    expected: str
    caught: bool
    caught_by: str | None
    """The first failing example's invariant ID, or ``mismatch`` / ``DPCollectiveTimeout`` / an exception type."""
    examples: int
    """Examples tried, the catching one included."""
    seconds: float
    as_expected: bool = False
    message: str = ""

    @property
    def by_contract(self) -> bool:
        return is_invariant(self.caught_by)


@dataclass
class BaselineResult:
    """One (backend, family) the corpus uses, run without any mutant: it must pass."""

    backend: str
    family: str
    options: dict[str, Any]
    examples: int
    passed: bool
    caught_by: str | None
    seconds: float
    message: str = ""


@dataclass(frozen=True)
class _Run:
    caught_by: str | None
    examples: int
    seconds: float
    message: str
    skipped: bool = False


def _first(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (Hypothesis may group what escaped a test)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _family_run(
    backend: str, family: str, *, examples: int, seed: int, options: Mapping[str, Any], timeout_s: float
) -> _Run:
    """``run_family`` in ``full`` mode; a failure that escapes it (the plain reference run) is a finding too."""
    tried = 0

    def count(result: FamilyResult) -> None:
        nonlocal tried
        tried = result.examples

    start = time.perf_counter()
    try:
        with contracts.enforce("full"):
            result = run_family(
                factory_for(backend),
                family,
                examples=examples,
                seed=seed,
                stop_at_first_failure=True,
                options=options,
                on_example=count,
                timeout_s=timeout_s,
            )
    except Exception as raw:
        exc = _first(raw)
        if isinstance(exc, ContractViolation):
            caught = exc.invariant_id
        elif isinstance(exc, DPCollectiveTimeout):
            caught = "DPCollectiveTimeout"
        else:
            caught = type(exc).__name__
        # Raised outside run_case's own handling, i.e. by the plain reference run; Hypothesis notes the example.
        notes = "\n".join(str(n) for n in getattr(exc, "__notes__", ()))
        message = f"{caught} (in the plain reference run): {exc}\n{notes}".strip()
        return _Run(caught, tried + 1, time.perf_counter() - start, message)
    seconds = time.perf_counter() - start
    if result.skipped:
        return _Run(None, 0, seconds, f"skipped: {result.skipped}", skipped=True)
    if result.failures:
        return _Run(
            result.caught_by[0], result.first_failure_example or result.examples, seconds, result.first_failure or ""
        )
    return _Run(None, result.examples, seconds, "")


def run_mutants(
    names: Sequence[str] | None = None,
    examples: int = DEFAULT_EXAMPLES,
    seed: int = 0,
    on_progress: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Every (or each named) mutant against its family, stopping at the first failing example."""
    results = []
    for mutant in get(None if names is None else list(names)):
        with mutant.apply():
            run = _family_run(
                mutant.backend,
                mutant.family,
                examples=examples,
                seed=seed,
                options=mutant.options,
                timeout_s=mutant.timeout_s,
            )
        result = MutantResult(
            name=mutant.name,
            backend=mutant.backend,
            family=mutant.family,
            expected=mutant.expected,
            caught=run.caught_by is not None,
            caught_by=run.caught_by,
            examples=run.examples,
            seconds=round(run.seconds, 3),
            as_expected=mutant.accepts(run.caught_by),
            message=run.message[:2000],
        )
        results.append(result)
        if on_progress is not None:
            on_progress(result)
    return results


def baseline_runs(mutants: Sequence[Mutant]) -> list[tuple[str, str, dict[str, Any]]]:
    """The distinct (backend, family, options) runs the mutants use, in corpus order."""
    seen: list[tuple[str, str, dict[str, Any]]] = []
    for m in mutants:
        key = (m.backend, m.family, dict(m.options))
        if key not in seen:
            seen.append(key)
    return seen


def run_baseline(
    names: Sequence[str] | None = None,
    examples: int = DEFAULT_EXAMPLES,
    seed: int = 0,
    on_progress: Callable[[BaselineResult], None] | None = None,
) -> list[BaselineResult]:
    """The families the (named) mutants use, without mutants, with the same examples: every one must pass."""
    results = []
    for backend, family, options in baseline_runs(get(None if names is None else list(names))):
        run = _family_run(backend, family, examples=examples, seed=seed, options=options, timeout_s=20.0)
        result = BaselineResult(
            backend=backend,
            family=family,
            options=options,
            examples=run.examples,
            passed=run.caught_by is None and not run.skipped,
            caught_by="skipped" if run.skipped else run.caught_by,
            seconds=round(run.seconds, 3),
            message=run.message[:2000],
        )
        results.append(result)
        if on_progress is not None:
            on_progress(result)
    return results


# -- the report --------------------------------------------------------------------------------------------------


def summary(results: Sequence[MutantResult]) -> dict[str, Any]:
    """Score (caught / total), caught by a contract vs only by a crash or mismatch, median examples to catch."""
    total = len(results)
    caught = [r for r in results if r.caught]
    by_contract = [r for r in caught if r.by_contract]
    return {
        "total": total,
        "caught": len(caught),
        "score": len(caught) / total if total else 0.0,
        "caught_by_contract": len(by_contract),
        "caught_only_by_crash_or_mismatch": len(caught) - len(by_contract),
        "caught_as_expected": sum(r.as_expected for r in results),
        "missed": [r.name for r in results if not r.caught],
        "unexpected": [f"{r.name}: {r.caught_by} (expected {r.expected})" for r in caught if not r.as_expected],
        "median_examples_to_catch": statistics.median(r.examples for r in caught) if caught else None,
        "seconds": round(sum(r.seconds for r in results), 1),
    }


def render_table(results: Sequence[MutantResult]) -> Any:
    """A rich table, one row per mutant."""
    from rich.table import Table

    table = Table(title=f"mutation corpus ({len(results)} mutants)")
    for column in ("mutant", "backend", "family", "expected", "caught by", "examples", "seconds", ""):
        table.add_column(column, overflow="fold")
    for r in results:
        if not r.caught:
            verdict = "[red]missed[/red]"
        elif r.as_expected:
            verdict = "[green]as expected[/green]" if r.by_contract else "[yellow]expected, not a contract[/yellow]"
        else:
            verdict = "[yellow]other[/yellow]" if r.by_contract else "[yellow]crash/mismatch only[/yellow]"
        table.add_row(
            r.name,
            r.backend,
            r.family,
            r.expected,
            r.caught_by or "-",
            str(r.examples),
            f"{r.seconds:.1f}",
            verdict,
        )
    return table


def render_baseline(results: Sequence[BaselineResult]) -> Any:
    from rich.table import Table

    table = Table(title="baseline: the same families without mutants")
    for column in ("backend", "family", "options", "examples", "seconds", "status"):
        table.add_column(column, overflow="fold")
    for r in results:
        status = "[green]passed[/green]" if r.passed else f"[red]failed: {r.caught_by}[/red]"
        table.add_row(r.backend, r.family, json.dumps(r.options), str(r.examples), f"{r.seconds:.1f}", status)
    return table


def main(names: Sequence[str] | None, examples: int, seed: int, json_path: str | Path | None) -> int:
    """``specdec mutate``: baseline, then the corpus; 1 when the baseline fails or a mutant is missed."""
    import torch
    from rich.console import Console

    torch.set_num_threads(1)  # tiny models: intra-op threads only add contention
    console = Console(width=max(Console().width, 140))  # tables stay readable in logs (no tty: 80 columns)
    console.print(f"baseline: the corpus's families without mutants ({examples} examples each, seed {seed})")
    baseline = run_baseline(
        names,
        examples,
        seed,
        lambda b: console.print(f"  {b.backend}/{b.family}: {'passed' if b.passed else 'FAILED ' + str(b.caught_by)}"),
    )
    console.print("mutants:")
    results = run_mutants(
        names,
        examples,
        seed,
        lambda r: console.print(f"  {r.name}: {r.caught_by or 'missed'} after {r.examples} example(s)"),
    )
    console.print(render_baseline(baseline))
    console.print(render_table(results))
    stats = summary(results)
    baseline_ok = all(b.passed for b in baseline)
    console.print(
        f"score {stats['caught']}/{stats['total']} ({stats['score']:.0%}); "
        f"by a contract {stats['caught_by_contract']}, "
        f"only by a crash or mismatch {stats['caught_only_by_crash_or_mismatch']}; as expected "
        f"{stats['caught_as_expected']}; median examples to catch {stats['median_examples_to_catch']}; "
        f"baseline {'passed' if baseline_ok else 'FAILED (the score is void)'}"
    )
    for line in stats["unexpected"]:
        console.print(f"[yellow]caught by another check than expected:[/yellow] {line}")
    if json_path is not None:
        payload = {
            "seed": seed,
            "examples": examples,
            "baseline_ok": baseline_ok,
            "summary": stats,
            "baseline": [asdict(b) for b in baseline],
            "results": [asdict(r) | {"by_contract": r.by_contract} for r in results],
        }
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_path}")
    return 0 if baseline_ok and stats["score"] == 1.0 else 1
