"""Test-wide settings: Hypothesis profiles and contracts in ``shapes`` mode by default."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
