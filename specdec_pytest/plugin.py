"""The conformance suite as pytest tests: one collector per backend, one item per (configuration family, tensor mode).

``pytest --specdec-backend my_pkg:make_speculator`` (or an installed backend's
name) collects ``specdec[ngram]`` with items ``specdec[ngram]::dp[cpu]`` and so
on, which ``--collect-only`` lists and ``-k`` / ``-m`` select like any test.
Each runs ``specdec.testing.conformance.run_family`` and fails with the
invariant ID, the violation, the generated configuration of the first failing
example and the one-line commands that rerun that example alone
(``--specdec-example N`` here, ``specdec matrix --example N`` outside pytest).
``cuda`` items are skipped without a GPU, never failed.

With a backend named, the session runs torch single-threaded (``--specdec-threads``),
a spec that does not resolve ends the run with one usage error before any test,
and ``--specdec-typecheck`` checks the backend's package with jaxtyping's import hook.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pytest

THREADS_ENV = "SPECDEC_THREADS"
"""Environment variable with the torch intra-op threads of a conformance session (``--specdec-threads`` wins)."""

TYPECHECKER = "beartype.beartype"
BACKENDS_GROUP = "specdec.backends"  # specdec.backend_registry.GROUP, not imported: see typecheck_packages


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specdec", "specdec backend conformance suite")
    group.addoption(
        "--specdec-backend",
        action="append",
        default=[],
        metavar="NAME|module:factory",
        help="run the conformance suite against this backend (repeatable)",
    )
    group.addoption("--specdec-examples", type=int, default=25, help="generated configurations per family (default 25)")
    group.addoption(
        "--specdec-families", default=None, help="comma-separated families (default: all); see specdec matrix --help"
    )
    group.addoption(
        "--specdec-tensor-modes",
        default="cpu,fake-cuda,cuda",
        help="comma-separated: cpu, fake-cuda, cuda (default all)",
    )
    group.addoption("--specdec-seed", type=int, default=0, help="seed of the generated configurations")
    group.addoption(
        "--specdec-example",
        type=int,
        default=None,
        metavar="N",
        help="run only generated example N (1-based) of each family, as a full run meets it (a failure's repro)",
    )
    group.addoption(
        "--specdec-threads",
        type=int,
        default=None,
        metavar="N",
        help=f"torch intra-op threads for the session (default: ${THREADS_ENV}, else torch's own if "
        "$OMP_NUM_THREADS is set, else 1: tiny models only lose time to a second thread)",
    )
    group.addoption(
        "--specdec-typecheck",
        action="store_true",
        default=False,
        help="check the backend's package with jaxtyping's import hook and beartype: a tensor of the wrong "
        "shape or dtype fails where it is passed",
    )


# -- the type hook: installed before conftests and test modules import the backend -----------------------------


def typecheck_packages(specs: Sequence[str]) -> list[str]:
    """The top-level packages of the backends ``specs`` name, without importing them.

    A ``module:factory`` spec names its module; an installed backend's name is
    looked up in its entry point. A name found nowhere adds nothing here (the
    session start reports it).
    """
    installed = {ep.name: ep.value for ep in entry_points(group=BACKENDS_GROUP)}
    packages: list[str] = []
    for spec in specs:
        target = spec if ":" in spec else installed.get(spec, "")
        package = target.partition(":")[0].strip().partition(".")[0]
        if package and package not in packages:
            packages.append(package)
    return packages


_HOOK_KEY = pytest.StashKey[Any]()
_THREADS_KEY = pytest.StashKey[int]()


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """``--specdec-typecheck``: instrument the backends' packages before anything imports them."""
    options = parser.parse_known_args(args)
    if not options.specdec_typecheck:
        return
    if not options.specdec_backend:
        raise pytest.UsageError("--specdec-typecheck checks the package of a --specdec-backend; none was given")
    named = {p.strip() for p in (getattr(options, "jaxtyping_packages", None) or "").split(",")[:-1]}
    packages = [p for p in typecheck_packages(options.specdec_backend) if p not in named]
    imported = sorted(p for p in packages if p in sys.modules)
    if imported:
        raise pytest.UsageError(
            f"--specdec-typecheck cannot check {', '.join(imported)}: imported before the type hook could be "
            "installed (by a plugin loaded with -p, or a sitecustomize); drop that import or run without the flag"
        )
    if packages:
        from jaxtyping import install_import_hook

        early_config.stash[_HOOK_KEY] = install_import_hook(packages, TYPECHECKER)


# -- the session: threads, then the specs and options checked once ----------------------------------------------


def _session_threads(config: pytest.Config) -> int | None:
    """The torch threads this session sets, or None where the user left them to torch (``$OMP_NUM_THREADS``)."""
    given: int | None = config.getoption("specdec_threads")
    source = "--specdec-threads"
    if given is None and os.environ.get(THREADS_ENV, "").strip():
        source = f"${THREADS_ENV}"
        try:
            given = int(os.environ[THREADS_ENV])
        except ValueError:
            raise pytest.UsageError(f"{source}={os.environ[THREADS_ENV]!r} is not a number of threads") from None
    if given is not None and given < 1:
        raise pytest.UsageError(f"{source} is a number of torch threads, at least 1; got {given}")
    if given is None and os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if given is None else given


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread for a conformance session, unless the user chose; the previous count is restored after."""
    if not config.getoption("specdec_backend") and config.getoption("specdec_threads") is None:
        return  # specdec is installed, but this is someone else's test run: leave torch alone
    threads = _session_threads(config)
    if threads is None:
        return
    import torch

    config.stash[_THREADS_KEY] = torch.get_num_threads()
    torch.set_num_threads(threads)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _THREADS_KEY in config.stash:
        import torch

        torch.set_num_threads(config.stash[_THREADS_KEY])
    if _HOOK_KEY in config.stash:
        config.stash[_HOOK_KEY].uninstall()


@dataclass(frozen=True)
class SuitePlan:
    """What the conformance suites of this session run: the backends (resolved once) and the chosen cells."""

    backends: tuple[str, ...]
    families: tuple[str, ...]
    modes: tuple[str, ...]


_PLAN_KEY = pytest.StashKey[SuitePlan]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Check the options and resolve every backend spec now: a mistake is one usage error, not a failing test each."""
    config = session.config
    backends: list[str] = config.getoption("specdec_backend")
    if not backends:
        return
    from specdec.cli.lists import comma_list
    from specdec.testing.conformance import FAMILIES, TENSOR_MODES

    families = comma_list(config.getoption("specdec_families")) or list(FAMILIES)
    modes = comma_list(config.getoption("specdec_tensor_modes")) or list(TENSOR_MODES)
    bad = [f for f in families if f not in FAMILIES] + [m for m in modes if m not in TENSOR_MODES]
    if bad:
        raise pytest.UsageError(
            f"unknown specdec families/tensor modes {bad}; families {sorted(FAMILIES)}, modes {TENSOR_MODES}"
        )
    example = config.getoption("specdec_example")
    if example is not None and example < 1:
        raise pytest.UsageError(f"--specdec-example is a 1-based index of a generated example, got {example}")
    for spec in backends:
        _resolve_or_usage_error(spec)
    config.stash[_PLAN_KEY] = SuitePlan(tuple(dict.fromkeys(backends)), tuple(families), tuple(modes))


def _resolve_or_usage_error(spec: str) -> None:
    """Load ``spec``'s factory; any failure becomes a usage error naming the spec, the cause and the choices."""
    from specdec.backend_registry import available_backends, factory_for

    try:
        factory_for(spec)
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, (ImportError, ValueError)):  # raised by the backend's own code: say where
            frames = _frames(exc.__traceback__)
            if frames:
                cause += f" (at {frames[-1]})"
        try:
            known = ", ".join(available_backends()) or "none"
        except ValueError as clash:  # two packages claim one name: that is worth saying too
            known = f"unknown ({clash})"
        raise pytest.UsageError(
            f"--specdec-backend {spec!r} does not resolve to a backend factory: {cause}\n"
            f"installed backends: {known}; or give an importable factory as package.module:factory"
        ) from None


def _frames(tb: Any) -> list[str]:
    out = []
    while tb is not None:
        out.append(f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        tb = tb.tb_next
    return out


# -- collection: one suite per backend, under the session -------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Add the conformance suites to the session's own collection, so they are counted and listed as tests."""
    report = yield
    plan = collector.config.stash.get(_PLAN_KEY, None)
    if isinstance(collector, pytest.Session) and plan is not None and report.passed:
        report.result.extend(
            ConformanceSuite.from_parent(
                collector, name=f"specdec[{backend}]", nodeid=f"specdec[{backend}]", backend=backend, plan=plan
            )
            for backend in plan.backends
        )
    return report


class ConformanceSuite(pytest.Collector):
    """One backend's conformance tests: an item per (tensor mode, family) of the session's plan."""

    def __init__(self, *, backend: str, plan: SuitePlan, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend, self.plan = backend, plan

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return [
            ConformanceItem.from_parent(self, name=f"{family}[{mode}]", backend=self.backend, family=family, mode=mode)
            for mode in self.plan.modes
            for family in self.plan.families
        ]

    def reportinfo(self) -> tuple[str, int | None, str]:
        return self.name, None, self.name


class ConformanceFailure(Exception):
    """A backend broke a contract, crashed, or differed from plain decoding on a generated configuration."""


class ConformanceItem(pytest.Item):
    def __init__(self, *, backend: str, family: str, mode: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend, self.family, self.mode = backend, family, mode

    def runtest(self) -> None:
        from specdec.backend_registry import factory_for
        from specdec.testing.conformance import run_family

        config = self.config
        seed = config.getoption("specdec_seed")
        result = run_family(
            factory_for(self.backend),
            self.family,
            examples=config.getoption("specdec_examples"),
            tensor_mode=self.mode,
            seed=seed,
            stop_at_first_failure=True,
            judge_axes=True,  # a conformance test claims the paths it names were taken
            example=config.getoption("specdec_example"),
            backend=self.backend,
        )
        if result.skipped:
            pytest.skip(f"{self.family}[{self.mode}]: {result.skipped}")
        self.user_properties.append(("draft_forward_evaluations", result.draft_forward_evaluations))
        if not result.passed:
            where = (
                f"at generated example {result.first_failure_example} of {result.examples}"
                if result.first_failure_example is not None
                else f"over its {result.examples} generated examples"
            )
            again = (
                f"--specdec-example {result.first_failure_example}"
                if result.first_failure_example is not None
                else f"--specdec-examples {result.examples}"
            )
            raise ConformanceFailure(
                f"{self.backend} failed family {self.family!r} ({self.mode}) {where}: {result.first_failure}\n"
                f"reproduce: {result.repro}\n"
                f"or: pytest -p no:cacheprovider --specdec-backend {shlex.quote(self.backend)} "
                f"--specdec-families {self.family} --specdec-tensor-modes {self.mode} --specdec-seed {seed} {again}"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return f"specdec[{self.backend}]", None, self.name
