"""Block-drafter evidence is checked by capability: a third-party drafter with DSpark-like evidence gets BLK-8.

``AcmeChainDrafter`` is a drafter outside the shipped backends, under its own
name, that drafts with a DSpark network and reports the same Markov,
confidence and capacity evidence. Reported faithfully it runs silent and
lossless in ``full`` mode; with one part of its evidence broken, BLK-8 stops
the engine, although no invariant names its backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

import contracts
from backends import create
from backends.dspark import DSparkSpeculator
from contracts import BlockEvidence, ContractViolation, StepKind
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, TargetStep

Planting = Callable[[BlockEvidence], BlockEvidence]


def _chain_not_at_anchor(ev: BlockEvidence) -> BlockEvidence:
    """The chain's first conditioning token is the anchor + 1, not the anchor."""
    assert ev.markov is not None
    prev = ev.markov.prev_token_ids.clone()
    prev[:, 0] += 1
    return dataclasses.replace(ev, markov=dataclasses.replace(ev.markov, prev_token_ids=prev))


def _capacity_not_prefix(ev: BlockEvidence) -> BlockEvidence:
    """The proposed slots are the last ``capacity`` ones (right-aligned), not a prefix."""
    assert ev.capacity is not None
    mask = ev.capacity.prefix_mask.flip(-1)
    return dataclasses.replace(ev, capacity=dataclasses.replace(ev.capacity, prefix_mask=mask))


def _survival_rises(ev: BlockEvidence) -> BlockEvidence:
    """Survival reported in reverse: increasing along the block."""
    assert ev.confidence is not None
    flipped = ev.confidence.survival.flip(-1)
    return dataclasses.replace(ev, confidence=dataclasses.replace(ev.confidence, survival=flipped))


class AcmeChainDrafter:
    """A third-party block drafter: DSpark's network and heads, its own name, evidence passed through ``plant``."""

    name = "acme-chain"
    draft_step_kinds = frozenset({StepKind.DRAFT_BLOCK})

    def __init__(self, inner: DSparkSpeculator, plant: Planting | None = None) -> None:
        self.inner = inner
        self.plant = plant
        self.num_spec_tokens = inner.num_spec_tokens
        self.aux_layers = inner.aux_layers
        self.with_evidence = 0

    def bind(self, target: Transformer, ctx: DraftContext) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = self.inner.propose(step, ctx)
        ev = proposal.evidence
        if ev is None or ev.markov is None:
            return proposal
        self.with_evidence += 1
        if self.plant is not None:
            ev = self.plant(ev)
        return dataclasses.replace(proposal, evidence=ev)

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)


def _run(target: Transformer, drafter: AcmeChainDrafter | None) -> dict[str, list[int]]:
    e = Engine(
        target,
        EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64)),
        speculator=drafter,
    )
    for i in range(3):
        e.add_request(f"q{i}", [3 + i, 17, 40 + i], max_tokens=12, params=SamplingParams(temperature=0.0))
    return e.run()


def _acme(target: Transformer, plant: Planting | None = None) -> AcmeChainDrafter:
    inner = create("dspark", target, num_spec_tokens=3, markov_scale=2.0, capacity="threshold", tau=0.2)
    assert isinstance(inner, DSparkSpeculator)
    return AcmeChainDrafter(inner, plant)


def test_faithful_third_party_evidence_runs_silent_and_lossless() -> None:
    target = Transformer(ModelConfig.tiny(), seed=0)
    drafter = _acme(target)
    with contracts.enforce("full"):
        outputs = _run(target, drafter)
    assert drafter.with_evidence > 0
    assert outputs == _run(target, None)


@pytest.mark.parametrize("plant", [_chain_not_at_anchor, _capacity_not_prefix, _survival_rises])
def test_third_party_evidence_with_a_planted_bug_is_caught_by_blk_8(plant: Planting) -> None:
    target = Transformer(ModelConfig.tiny(), seed=0)
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        _run(target, _acme(target, plant))
    assert info.value.invariant_id == "BLK-8"
    assert "acme-chain" in str(info.value)
