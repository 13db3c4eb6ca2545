"""A drafter packs its weights and cuts its draft vocabulary's sub-head when it is bound, not in its first step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import specdec.nn.packed_linear as packed_linear
from backends.autoregressive import AutoregressiveSpeculator, EagleHead
from backends.dflash import DFlashSpeculator
from backends.dflash.network import DFlashNetwork
from backends.draft_vocab import DraftVocab
from backends.registry import spread_layers
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.packed_linear import mkldnn_available
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

pytestmark = pytest.mark.skipif(not mkldnn_available(), reason="this torch build has no oneDNN: nothing is packed")

CONFIG = EngineConfig(num_blocks=64, block_size=8, scheduler=SchedulerConfig(max_model_len=128))
# Large enough for the fp32 packed path (every weight at least 256 x 256 elements).
MODEL = ModelConfig.tiny(
    vocab_size=1024, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64, intermediate_size=512
)


@pytest.fixture(scope="module")
def target() -> Transformer:
    model = Transformer(MODEL, seed=0)
    engine = Engine(model, CONFIG)  # the target's own weights are packed on its first forwards
    engine.add_request("warm", [1, 2, 3], max_tokens=3)
    while engine.has_work:
        engine.step()
    # Where load() timed F.linear faster at one row (process-wide, set by an earlier test's load), those forwards
    # packed nothing; pack the target here so the test sees only what the drafter packs.
    for linear, weights in model.decode_products():
        linear.packed(weights)
    return model


def eagle(target: Transformer) -> Speculator:
    aux = spread_layers(target.config.num_layers)
    head = EagleHead(target, num_aux=len(aux), seed=1)
    head.draft_vocab = DraftVocab(torch.arange(0, 1024, 2), 1024)
    return AutoregressiveSpeculator(head, num_spec_tokens=3, aux_layers=aux, name="eagle")


def dflash(target: Transformer) -> Speculator:
    aux = spread_layers(target.config.num_layers)
    network = DFlashNetwork(target, num_aux=len(aux), num_layers=1, seed=1)
    network.draft_vocab = DraftVocab(torch.arange(0, 1024, 2), 1024)
    return DFlashSpeculator(network, num_spec_tokens=3, aux_layers=aux)


@pytest.mark.parametrize("make", [eagle, dflash], ids=["eagle", "dflash"])
def test_a_bound_drafter_packs_nothing_while_it_decodes(
    target: Transformer, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(target, CONFIG, speculator=make(target))
    packs: list[tuple[int, ...]] = []
    real = packed_linear.PackedLinear._pack

    def counting(self: packed_linear.PackedLinear, weights: Any) -> torch.Tensor:
        if self._packed is None:
            packs.append(tuple(weights[0].shape))
        return real(self, weights)

    monkeypatch.setattr(packed_linear.PackedLinear, "_pack", counting)
    engine.add_request("r", [5, 6, 7, 8], max_tokens=12)
    while engine.has_work:
        engine.step()
    assert engine.metrics.snapshot().counts()["drafted"] > 0
    assert packs == [], f"weights packed inside decode steps: {packs}"
