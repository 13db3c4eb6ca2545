"""specdec inside a real vLLM: these tests run only where vLLM is importable (``.ci/vllm-env`` builds that venv)."""

from __future__ import annotations

import importlib.util

import pytest


def vllm_installed() -> bool:
    """Whether a real vLLM is importable.

    pytest puts ``tests/`` on ``sys.path``, so this folder itself is a namespace package named ``vllm``
    wherever vLLM is not installed (an installed vLLM, a regular package, wins); only a spec with a file counts.
    """
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


@pytest.fixture(autouse=True)
def _require_vllm() -> None:
    if not vllm_installed():
        pytest.skip("vLLM is not installed in this environment; .ci/vllm-env builds the one these tests run in")
