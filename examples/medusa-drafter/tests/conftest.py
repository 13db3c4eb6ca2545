"""Contracts in ``shapes`` mode for every test, as in specdec's own suite, and single-threaded torch."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import contracts

# Tiny models gain nothing from intra-op threads and slow down badly on a loaded small machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _contracts_in_shapes_mode() -> Iterator[None]:
    with contracts.enforce(os.environ.get("SPECDEC_TEST_CONTRACTS", "shapes")):
        yield
