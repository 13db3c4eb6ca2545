"""Fixtures for tests on real, pulled models (not a test module).

A model that is not pulled skips those tests with the command that pulls it,
except under CI (``CI`` set), where ``.ci/run`` pulls it first and a missing
model is a failure rather than a silently skipped parity check. A cache that
exists but is corrupt is never skipped: loading it fails loudly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec.hub import ModelStore, Tokenizer, load
from specdec.nn.transformer import Transformer

SMOLLM2 = "smollm2-135m-instruct"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class PulledModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    path: Path
    source_gguf: Path


def require_pulled(name: str) -> ModelStore:
    """The store holding ``name``; skips (or under CI fails) when the model was never pulled."""
    store = ModelStore()
    if store.problems(name, hash_files=False) == ["not pulled"]:
        reason = (
            f"{name} is not pulled into {store.path(name)}; run `specdec models pull {name}` (needs the package index)"
        )
        if in_ci():
            pytest.fail(f"CI is set but {reason}", pytrace=False)
        pytest.skip(reason)
    return store


def load_pulled(name: str) -> PulledModel:
    store = require_pulled(name)
    model, tokenizer = load(name, store=store, download=False)
    return PulledModel(name, model, tokenizer, store.path(name), store.source_gguf(name))


@pytest.fixture(scope="session")
def smollm2() -> PulledModel:
    """SmolLM2-135M-Instruct in the project's own ``Transformer`` (fp32), with its tokenizer."""
    return load_pulled(SMOLLM2)
