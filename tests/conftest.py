"""Test-wide settings: Hypothesis profiles, contracts in ``shapes`` mode by default, markers by folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import contracts

pytest_plugins = ("pytester",)

settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine they
# make torch up to an order of magnitude slower; tests run torch single-threaded.
torch.set_num_threads(1)

settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _contracts_in_shapes_mode() -> Iterator[None]:
    """Tests run with shape contracts on, as debug runs do; a test may switch modes."""
    with contracts.enforce(os.environ.get("SPECDEC_TEST_CONTRACTS", "shapes")):
        yield


KINDS = ("unit", "integration", "real_model", "bench", "with_vllm")
SLOW_KINDS = {"integration", "real_model", "bench", "with_vllm"}
"""Kinds whose every test is slow: whole engine runs, DP ranks, SmolLM2, benchmarks end to end.

``pytest -m "not slow"`` is then the unit tests less the few that train or generate for seconds
(marked by hand): about a minute on two cores, for the edit-test loop.
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by the folder it lives in, so ``-m unit`` or ``-m "not slow"`` selects by kind."""
    root = Path(__file__).parent
    for item in items:
        try:
            kind = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue  # a test outside tests/ (the example backend's own suite)
        if kind in KINDS:
            item.add_marker(kind)
            if kind in SLOW_KINDS:
                item.add_marker("slow")
