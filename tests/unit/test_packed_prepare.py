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
from specdec.nn.packed_linear import mkldnn_available, mkldnn_bf16_available
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


def drafter_packed_copies(speculator: Speculator) -> list[packed_linear.PackedLinear]:
    """Every ``PackedLinear`` the drafter network holds, alone or in a list (the target's are not among them)."""
    found = []
    for module in speculator.network.modules():  # type: ignore[attr-defined]
        for value in vars(module).values():
            for item in value if isinstance(value, list | tuple) else (value,):
                if isinstance(item, packed_linear.PackedLinear):
                    found.append(item)
    return found


@pytest.mark.skipif(not mkldnn_bf16_available(), reason="this CPU has no oneDNN bf16 matmul: bf16 is not packed")
@pytest.mark.parametrize("make", [eagle, dflash], ids=["eagle", "dflash"])
def test_a_bound_drafter_multiplies_at_most_its_row_chunk_per_call(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter's context catch-up over a long prompt goes in pieces of at most ``DRAFTER_ROW_CHUNK`` rows, whose
    row counts recur (a new row count makes oneDNN build a kernel); the target's own linears are left as they are.
    bf16, where every product is packed (fp32 sends more than 64 rows to MKL's ``F.linear``)."""
    target = Transformer(MODEL, seed=0, dtype=torch.bfloat16)
    speculator = make(target)
    engine = Engine(target, CONFIG, speculator=speculator)
    copies = drafter_packed_copies(speculator)
    assert copies and all(c.row_chunk == packed_linear.DRAFTER_ROW_CHUNK for c in copies)
    assert all(linear.row_chunk is None for linear, _ in target.decode_products())
    drafter_packs = {id(c._packed) for c in copies if c._packed is not None}
    rows: list[int] = []
    real = packed_linear.packed_product

    def recording(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        if id(packed) in drafter_packs:
            rows.append(x.shape[0])
        return real(x, packed)

    monkeypatch.setattr(packed_linear, "packed_product", recording)
    engine.add_request("r", [(7 * i) % 1000 + 1 for i in range(100)], max_tokens=8)
    while engine.has_work:
        engine.step()
    assert rows and max(rows) == packed_linear.DRAFTER_ROW_CHUNK, rows  # the 100-row prefill context came in pieces
