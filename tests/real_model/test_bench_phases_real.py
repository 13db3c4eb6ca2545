"""``specdec bench-phases`` on the cached SmolLM2 with the bench's own knobs: ``-O``, ``--batch-invariant``, ``--verify-attention``.

Without them a phase split of a lookup-first or batch-invariant bench run could
not be taken at all, and an option that silently never reached the factory
would time the wrong drafter.
"""

from __future__ import annotations

from typing import Any

import pytest
from real_models import SMOLLM2, PulledModel, smollm2  # noqa: F401  (fixture)

import specdec.backend_registry
from backends.lookup_first import LookupFirst
from specdec.cli.main import main
from specdec.nn.packed_linear import fp32_kernel_choice


def test_options_reach_the_factory_and_the_target(
    smollm2: PulledModel,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    made: list[tuple[Any, Any]] = []
    create = specdec.backend_registry.create

    def recording(name: str, target: Any, **options: Any) -> Any:
        speculator = create(name, target, **options)
        made.append((target, speculator))
        return speculator

    monkeypatch.setattr(specdec.backend_registry, "create", recording)
    argv = ["bench-phases", "--model", SMOLLM2, "--backends", "dflash", "--prompts", "1", "--max-tokens", "6"]
    given = ["--batch-invariant", "--verify-attention", "batched", "-O", "lookup=3", "--threads", "2"]
    assert main([*argv, "--rounds", "1", *given]) == 0
    assert made and all(isinstance(s, LookupFirst) and s.min_match == 3 for _, s in made)
    assert all(t.batch_invariant and not t.exact_verify for t, _ in made)
    out = capsys.readouterr().out
    assert "| dflash |" in out
    assert out.startswith(f"{SMOLLM2} in float32 ({fp32_kernel_choice()}), 2 thread(s)")

    made.clear()
    assert main([*argv, "--rounds", "1", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith(f"{SMOLLM2} in bfloat16, ")  # bf16 always packs: no kernel phrase
    assert made and not any(isinstance(s, LookupFirst) for _, s in made)
    assert not any(t.batch_invariant or not t.exact_verify for t, _ in made)


def test_a_refused_value_is_the_users_mistake(
    smollm2: PulledModel,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench-phases", "--model", SMOLLM2, "--backends", "eagle", "-O", "lookup=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: backend 'eagle' refused its options (lookup=-1): lookup is the shortest")
    assert err.count("\n") == 1
