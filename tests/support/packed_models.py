"""A model whose every weight takes the fp32 packed path, and the process-wide kernel choice kept per test.

The fixtures are registered for the unit tests by ``tests/unit/conftest.py``; a module that changes the choice
marks itself ``pytest.mark.usefixtures("restore_choice")``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specdec.nn.config import ModelConfig
from specdec.nn.packed_linear import fp32_f_linear_rows, set_fp32_f_linear_rows
from specdec.nn.transformer import Transformer

# Every weight at least 256 x 256 elements: the fp32 packed path applies, as on a real model.
MEDIUM = ModelConfig.tiny(
    vocab_size=1024, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64, intermediate_size=512
)


@pytest.fixture
def restore_choice() -> Iterator[None]:
    """The choice is process-wide: each test leaves it as it found it."""
    before = fp32_f_linear_rows()
    yield
    set_fp32_f_linear_rows(before)


@pytest.fixture(scope="module")
def medium() -> Transformer:
    return Transformer(MEDIUM, seed=0)
