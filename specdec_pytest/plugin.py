"""One pytest item per (backend, configuration family, tensor mode) of the conformance suite.

``pytest --specdec-backend my_pkg:make_speculator`` (or an installed backend's
name) adds items with ids like ``specdec[ngram]::dp[cpu]``; each runs
``specdec.testing.conformance.run_family`` and fails with the invariant ID,
the violation, the generated configuration of the first failing example and
the one-line commands that rerun that example alone (``--specdec-example N``
here, ``specdec matrix --example N`` outside pytest). ``cuda`` items are
skipped without a GPU, never failed.
"""

from __future__ import annotations

import shlex
from typing import Any

import pytest


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


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so those select conformance items too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
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
    for backend in backends:
        for mode in modes:
            for family in families:
                items.append(
                    ConformanceItem.from_parent(
                        session, name=f"specdec[{backend}]::{family}[{mode}]", backend=backend, family=family, mode=mode
                    )
                )


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
        return "specdec conformance", None, self.name
