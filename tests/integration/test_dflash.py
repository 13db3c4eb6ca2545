"""The DFlash block drafter: lossless over the DP/graph/K matrix, its caches, and the follow-up DP-padding bug.

The follow-up to the motivating vLLM fix: block drafters built their attention
metadata with ``desc.num_tokens`` (DP pad included) as the attention token
count; FlashInfer then failed with ``q.shape[0] (52) != qo_indptr[-1] (48)``.
The pre-fix behaviour is the mutant ``dflash-dp-pad-block-attention`` (it patches ``block_attention_rows``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lossless_sampling import ALPHA, exact_joint, p_value, sample_engine

import contracts
from backends import create
from backends.dflash import DFlashNetwork, DFlashSpeculator
from backends.registry import spread_layers
from contracts import ContractViolation
from specdec.dispatch import CaptureConfig
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig, MoEConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator
from specdec.testing.dp_run import DPRunSpec, RequestSpec, dp_run_specs, merged, plain_outputs, run_in_process

PRE_FIX = ("dflash-dp-pad-block-attention",)
TARGET = ModelConfig.tiny()


def dflash(k: int) -> Callable[[Transformer], Speculator]:
    return lambda t: create("dflash", t, num_spec_tokens=k)


@st.composite
def runs(draw: st.DrawFn) -> DPRunSpec:
    spec = draw(dp_run_specs(TARGET))
    return dataclasses.replace(spec, speculator=dflash(draw(st.integers(1, 5))))


@settings(max_examples=25)
@given(runs())
def test_greedy_dflash_output_equals_plain_greedy(spec: DPRunSpec) -> None:
    results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    assert len({r.collectives for r in results}) == 1


def echo_target() -> Transformer:
    """A tied-embedding target with shrunk embeddings: its greedy output often, not always, repeats a token."""
    target = Transformer(ModelConfig.tiny(tie_word_embeddings=True), seed=1)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(0.3)
    return target


def echo_speculator(target: Transformer, k: int) -> DFlashSpeculator:
    """NOT a trained DFlash drafter: ``echo=True`` makes every block row propose what the shared LM head reads off
    the bonus token's embedding (for a tied head: the bonus itself), so it is accepted exactly when the target
    repeats. The real injection, block attention and metadata paths still run; only the output rows are replaced."""
    aux = spread_layers(target.config.num_layers, count=5)
    network = DFlashNetwork(target, num_aux=len(aux), seed=1, echo=True)
    return DFlashSpeculator(network, num_spec_tokens=k, aux_layers=aux)


def engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64))


def run_engine(target: Transformer, speculator: Speculator | None, n: int = 4) -> tuple[Engine, dict[str, list[int]]]:
    engine = Engine(target, engine_config(), speculator=speculator)
    for i in range(n):
        engine.add_request(f"q{i}", [3 + i, 17, 40 + i], max_tokens=24)
    return engine, engine.run()


def test_an_agreeing_drafter_exercises_full_and_partial_acceptance() -> None:
    target = echo_target()
    k = 3
    engine, out = run_engine(target, echo_speculator(target, k))
    _, plain = run_engine(target, None)
    assert out == plain
    m = engine.metrics
    assert 0 < m.accepted < m.drafted  # some drafts rejected
    assert m.accepted_by_position[k - 1] > 0  # some verify steps accepted all K drafts (and emitted the bonus)
    assert m.acceptance_length > 2.0


def test_a_random_dflash_head_rarely_agrees_but_stays_lossless() -> None:
    target = Transformer(TARGET, seed=0)
    engine, out = run_engine(target, create("dflash", target, num_spec_tokens=4))
    assert out == run_engine(target, None)[1]
    assert engine.metrics.drafted > 0 and engine.metrics.accepted < engine.metrics.drafted


def test_draft_and_target_caches_hold_exactly_the_committed_length_after_every_step() -> None:
    target = Transformer(TARGET, seed=2)
    spec = echo_speculator(target, 4)
    engine = Engine(
        target,
        EngineConfig(
            num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=10, max_model_len=64)
        ),
        speculator=spec,
    )
    for i in range(6):
        engine.add_request(f"c{i}", list(range(1 + i, 9 + 2 * i)), max_tokens=30)
    steps = 0
    with contracts.enforce("full"):
        while engine.has_work:
            engine.step()
            steps += 1
            for rid, req in engine.requests.items():
                if req.finish_reason is None and rid in engine.kv and engine.kv.length(rid) > 0:  # not preempted
                    assert engine.kv.length(rid) == req.num_computed == spec.kv.length(rid), rid
    assert steps > 20 and spec.kv.requests == ()


def test_rejected_rows_written_into_the_draft_cache_are_caught_by_blk_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug pattern: context slots for every target row, rejected drafts included (BLK-6, ``full`` mode)."""

    def every_row(self: DFlashSpeculator, step: object) -> list[int]:
        rows = step.scheduled  # type: ignore[attr-defined]
        self.kv.ensure_capacities({s.req_id: s.seq_len for s in rows})
        return [
            slot for s in rows for slot in self.kv.slot_mapping(s.req_id, list(range(s.num_computed_tokens, s.seq_len)))
        ]

    target = echo_target()
    monkeypatch.setattr(DFlashSpeculator, "_context_slots", every_row)
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        run_engine(target, echo_speculator(target, 3))
    assert info.value.invariant_id == "BLK-6"
    assert "context rows not committed but written" in info.value.observed


def test_every_proposal_checks_its_block_step_even_when_no_rank_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The context write is checked on steps without a block forward too (prefill-only and all-finished steps)."""
    from specdec.speculator import DraftContext

    checked: list[int] = []
    real = DraftContext.check_batch

    def counting(self: DraftContext, step_kind: contracts.StepKind, facts: contracts.BatchFacts) -> None:
        checked.append(facts.num_reqs)
        real(self, step_kind, facts)

    monkeypatch.setattr(DraftContext, "check_batch", counting)
    target = echo_target()
    spec = echo_speculator(target, 3)
    proposals = 0
    real_propose = spec.propose

    def count_propose(*args: object) -> object:
        nonlocal proposals
        proposals += 1
        return real_propose(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(spec, "propose", count_propose)
    real_take = spec.take_context

    def count_take(*args: object) -> None:  # a step where nobody drafts makes no proposal (take_context)
        nonlocal proposals
        proposals += 1
        real_take(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(spec, "take_context", count_take)
    run_engine(target, spec)
    assert len(checked) == proposals and 0 in checked and any(checked)


# -- the follow-up bug: DP padding in block-drafter attention metadata ------------------------------------------


def moe_dflash(target: Transformer) -> Speculator:
    """A DFlash drafter with an expert-parallel MoE layer: its all-gather needs equal model rows on every rank."""
    layer = target.config.model_copy(update={"num_layers": 1, "moe": MoEConfig(num_experts=4, top_k=2)})
    aux = spread_layers(target.config.num_layers, count=5)
    network = DFlashNetwork(target, num_aux=len(aux), seed=5, layer_config=layer)
    return DFlashSpeculator(network, num_spec_tokens=3, aux_layers=aux)


def uneven_spec(mutants: tuple[str, ...] = ()) -> DPRunSpec:
    counts = [13, 13, 12, 13]
    requests = tuple(
        tuple(RequestSpec(f"r{rank}-{i}", (1 + (i * 7 + rank) % 90, 2 + i % 5), max_tokens=4) for i in range(n))
        for rank, n in enumerate(counts)
    )
    engine = EngineConfig(
        num_blocks=256,
        block_size=8,
        capture=CaptureConfig(),  # eager: ranks keep their own counts; the drafter pads model rows to 13 * q
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=128),
    )
    return DPRunSpec(TARGET, 0, engine, requests, moe_dflash, mutants=mutants)


def test_pre_fix_block_drafter_fails_in_attention_without_contracts() -> None:
    with contracts.enforce("off"), pytest.raises(RuntimeError) as info:
        run_in_process(uneven_spec(PRE_FIX))
    assert "q.shape[0] (52) != qo_indptr[-1] (48)" in str(info.value)


def test_shape_contracts_name_blk_3_before_attention_runs() -> None:
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as info:
        run_in_process(uneven_spec(PRE_FIX))
    err = info.value
    assert err.invariant_id == "BLK-3"
    assert err.step_kind == "draft_block" and "dflash" in (err.component or "")
    assert "DP padding" in (err.likely_cause or "")
    assert err.observed["meta.num_tokens_padded"] == 52 and err.observed["expected attention tokens"] == 48


@pytest.mark.parametrize("mode", ["off", "shapes", "full"])
def test_fixed_block_drafter_completes_on_every_rank_and_matches_plain_decoding(mode: str) -> None:
    spec = uneven_spec()
    with contracts.enforce(mode):
        results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    assert len({r.collectives for r in results}) == 1
    assert all(r.metrics.drafted > 0 for r in results)


# -- lossless sampling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argmax", [True, False], ids=["argmax drafts", "sampled drafts"])
def test_dflash_sampling_follows_the_target_distribution(argmax: bool) -> None:
    from test_lossless_sampling import TARGET as SMALL

    def make() -> DFlashSpeculator:
        aux = spread_layers(SMALL.config.num_layers, count=5)
        network = DFlashNetwork(SMALL, num_aux=len(aux), seed=3)
        return DFlashSpeculator(network, num_spec_tokens=2, aux_layers=aux, seed=3, argmax_drafts=argmax)

    params = SamplingParams(temperature=1.0)
    counts = sample_engine(make, params, seed=1234)  # type: ignore[arg-type]
    assert sum(counts.values()) == 1600
    assert p_value(counts, exact_joint(params)) > ALPHA


@pytest.mark.parametrize("backend", ["dflash", "dspark"])
def test_a_model_too_short_for_one_block_is_refused_at_bind(backend: str) -> None:
    # At the model's end a block is clamped to max_model_len keys: fewer keys than queries is no valid attention
    # (PAD-2 caught the block the matrix built for max_model_len 3 and K = 3 before bind refused it).
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    speculator = create(backend, target, num_spec_tokens=3)
    width = speculator.query_width  # type: ignore[attr-defined]
    config = EngineConfig(num_blocks=16, block_size=4, scheduler=SchedulerConfig(max_model_len=width - 1))
    with pytest.raises(ValueError, match=f"drafts blocks of {width} queries, which max_model_len={width - 1}"):
        Engine(target, config, speculator=speculator)
    Engine(target, dataclasses.replace(config, scheduler=SchedulerConfig(max_model_len=width)), speculator=speculator)
