"""Speculative decoding is lossless: greedy output equals plain greedy decoding token for token.

Random tiny targets; drafters that never, sometimes and always agree with the
target (a random EAGLE head, a random small draft model, the target with
perturbed weights, the target itself); any K; batches mixing prefill chunks and
decode; graph modes with capture sizes; DP sizes 1, 2, 4 with uneven and idle
ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import perturbed_copy

from backends import create
from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter
from specdec.engine import EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator
from specdec.testing.dp_run import DPRunSpec, RequestSpec, dp_run_specs, merged, plain_outputs, run_in_process

TARGET = ModelConfig.tiny()


def self_drafter(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    return lambda t: AutoregressiveSpeculator(ModelDrafter(t), num_spec_tokens=k, fused=fused, name="self")


def perturbed_drafter(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    return lambda t: AutoregressiveSpeculator(
        ModelDrafter(perturbed_copy(t, 0.6, 3)), num_spec_tokens=k, fused=fused, name="perturbed"
    )


def eagle(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    return lambda t: create("eagle", t, num_spec_tokens=k, fused=fused)


def draft_model(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    return lambda t: create("draft-model", t, num_spec_tokens=k, fused=fused)


def eagle_lookup_first(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    return lambda t: create("eagle", t, num_spec_tokens=k, fused=fused, lookup=1)


def eagle_lookup_past_k(k: int, fused: bool) -> Callable[[Transformer], Speculator]:
    """Lookup drafts up to K + 3 (the engine's K) where EAGLE drafts K."""
    return lambda t: create("eagle", t, num_spec_tokens=k, fused=fused, lookup=1, lookup_drafts=k + 3)


DRAFTERS = {
    "self": self_drafter,
    "perturbed": perturbed_drafter,
    "eagle": eagle,
    "draft-model": draft_model,
    "eagle, lookup first": eagle_lookup_first,
    "eagle, lookup first past K": eagle_lookup_past_k,
}


@st.composite
def runs(draw: st.DrawFn) -> tuple[DPRunSpec, str]:
    spec = draw(dp_run_specs(TARGET))
    k = draw(st.integers(1, 5))
    drafter = draw(st.sampled_from(sorted(DRAFTERS)))
    fused = draw(st.booleans())
    return dataclasses.replace(spec, speculator=DRAFTERS[drafter](k, fused)), drafter


@settings(max_examples=40)
@given(runs())
def test_greedy_speculative_output_equals_plain_greedy(case: tuple[DPRunSpec, str]) -> None:
    spec, _ = case
    results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    assert len({r.collectives for r in results}) == 1


@pytest.mark.parametrize("fused", [False, True])
def test_acceptance_paths_are_all_exercised(fused: bool) -> None:
    """Full acceptance with the bonus token, partial acceptance, and rejection at the first draft."""
    requests = (tuple(RequestSpec(f"q{i}", (3 + i, 17, 40 + i), max_tokens=24) for i in range(4)),)
    engine = EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64))
    seen = {}
    for name in ("self", "perturbed", "eagle"):
        spec = DPRunSpec(TARGET, 0, engine, requests, DRAFTERS[name](4, fused))
        (result,) = run_in_process(spec)
        assert result.outputs == plain_outputs(spec)
        seen[name] = result.metrics
    full = seen["self"]
    assert full.accepted == full.drafted > 0  # every draft accepted, so every verify also emitted the bonus
    assert full.acceptance_length > 4.0
    partial = seen["perturbed"]
    assert 0 < partial.accepted < partial.drafted
    assert 0 < partial.accepted_by_position[0] < partial.drafted_by_position[0]
    assert seen["eagle"].accepted < seen["eagle"].drafted
