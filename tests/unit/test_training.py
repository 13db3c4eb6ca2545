"""Training the drafters (EAGLE head, DFlash, DSpark) on the target's own greedy continuations makes them agree with it more.

A tiny random target (small vocabulary, so a few hundred steps suffice) writes
its own training data; DFlash and DSpark drafters are trained on it, and the
real engine then measures acceptance length on held-out prompts: trained must
beat untrained, and output must still equal plain greedy decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import Int
from torch import Tensor

from backends.autoregressive import AutoregressiveSpeculator, EagleHead
from backends.dflash import DFlashNetwork, DFlashSpeculator
from backends.dflash.network import MASK_TOKEN_ID
from backends.dspark import DSparkHeads, DSparkSpeculator
from backends.registry import spread_layers
from backends.training import (
    TrainSchedule,
    block_hidden,
    generate_sequences,
    target_features,
    train_dflash,
    train_dspark,
    train_eagle,
    unrolled_hidden,
)
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep

VOCAB = 32
K = 3


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=0)


@pytest.fixture(scope="module")
def sequences(target: Transformer) -> Int[Tensor, "num seq_len"]:
    return generate_sequences(target, 48, prompt_len=4, gen_len=28, seed=0)


def aux_layers(target: Transformer) -> tuple[int, ...]:
    return spread_layers(target.config.num_layers, count=5)


def run(target: Transformer, speculator: Speculator | None) -> tuple[float, dict[str, list[int]]]:
    """Acceptance length and outputs on held-out random prompts (a different seed from the training data)."""
    engine = Engine(
        target,
        EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64)),
        speculator=speculator,
    )
    g = torch.Generator().manual_seed(123)
    for i in range(6):
        engine.add_request(f"q{i}", torch.randint(0, VOCAB, (4,), generator=g).tolist(), max_tokens=24)
    out = engine.run()
    return engine.metrics.acceptance_length, out


@pytest.mark.slow  # trains or generates for seconds: not in the quick subset
def test_dflash_training_lowers_loss_and_raises_tau(target: Transformer, sequences: Tensor) -> None:
    aux = aux_layers(target)
    network = DFlashNetwork(target, num_aux=len(aux), seed=1)
    before, _ = run(target, DFlashSpeculator(network, num_spec_tokens=K, aux_layers=aux))
    frozen = {n: p.detach().clone() for n, p in target.named_parameters()}
    losses = train_dflash(network, target, sequences, TrainSchedule(steps=200, lr=1e-2), block_size=K + 1)
    after, out = run(target, DFlashSpeculator(network, num_spec_tokens=K, aux_layers=aux))
    print(f"DFlash tau untrained {before:.3f} trained {after:.3f}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert after > before
    assert out == run(target, None)[1]
    assert not any(p.requires_grad for p in network.parameters())  # inference state restored
    assert all(torch.equal(p, frozen[n]) for n, p in target.named_parameters())  # target untouched


@pytest.mark.slow  # trains or generates for seconds: not in the quick subset
def test_dspark_training_lowers_loss_and_raises_tau(target: Transformer, sequences: Tensor) -> None:
    aux = aux_layers(target)

    def build() -> tuple[DFlashNetwork, DSparkHeads]:
        c = target.config
        return DFlashNetwork(target, num_aux=len(aux), seed=1), DSparkHeads(c.hidden_size, c.vocab_size, seed=1)

    network, heads = build()
    before, _ = run(target, DSparkSpeculator(network, heads, num_spec_tokens=K, aux_layers=aux))
    losses = train_dspark(network, heads, target, sequences, TrainSchedule(steps=200, lr=1e-2), block_size=K)
    after, out = run(target, DSparkSpeculator(network, heads, num_spec_tokens=K, aux_layers=aux))
    print(f"DSpark tau untrained {before:.3f} trained {after:.3f}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert after > before
    assert out == run(target, None)[1]


class Recording(DFlashSpeculator):
    """Records (anchor position, bonus, drafts) of every drafting proposal of request 0."""

    def __init__(self, network: DFlashNetwork, aux: tuple[int, ...]) -> None:
        super().__init__(network, num_spec_tokens=K, aux_layers=aux)
        self.seen: list[tuple[int, int, list[int]]] = []

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = super().propose(step, ctx)
        if step.drafting[0]:
            drafts = proposal.draft_token_ids[0].tolist()
            self.seen.append((step.base_positions[0] + 1, step.next_token_ids[0], drafts))
        return proposal


def test_dense_training_forward_drafts_what_the_paged_inference_path_drafts(
    target: Transformer, sequences: Tensor
) -> None:
    """The trained weights are the inference weights: the dense block forward reproduces the engine's drafts."""
    aux = aux_layers(target)
    network = DFlashNetwork(target, num_aux=len(aux), seed=1)
    train_dflash(
        network, target, sequences, TrainSchedule(steps=60, lr=1e-2), block_size=K + 1
    )  # context-dependent drafts
    spec = Recording(network, aux)
    engine = Engine(
        target, EngineConfig(num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_model_len=64)), speculator=spec
    )
    prompt = [5, 9, 2, 30]
    engine.add_request("r", prompt, max_tokens=16)
    tokens = torch.tensor(prompt + engine.run()["r"])
    feats = target_features(target, tokens[None], aux)
    assert len({tuple(d) for _, _, d in spec.seen}) > 3  # varied drafts, so a wrong context or position shows
    with torch.no_grad():
        for anchor, bonus, drafts in spec.seen:
            ids = torch.tensor([[bonus] + [MASK_TOKEN_ID] * K])
            hidden = block_hidden(network, feats.aux, ids, torch.tensor([[anchor]]), K + 1)
            logits = target.compute_logits(network.norm(hidden[0]))
            assert logits[1:].argmax(-1).tolist() == drafts, f"anchor {anchor}"


@pytest.mark.slow  # trains or generates for seconds: not in the quick subset
def test_eagle_training_lowers_loss_and_raises_tau(target: Transformer, sequences: Tensor) -> None:
    aux = spread_layers(target.config.num_layers)

    def speculator(head: EagleHead) -> AutoregressiveSpeculator:
        return AutoregressiveSpeculator(head, num_spec_tokens=K, aux_layers=aux, name="eagle")

    head = EagleHead(target, num_aux=len(aux), seed=1)
    before, _ = run(target, speculator(head))
    frozen = {n: p.detach().clone() for n, p in target.named_parameters()}
    losses = train_eagle(head, target, sequences, TrainSchedule(steps=200, lr=1e-2), depth=K)
    after, out = run(target, speculator(head))
    print(f"EAGLE tau untrained {before:.3f} trained {after:.3f}; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert after > before
    assert out == run(target, None)[1]
    assert not any(p.requires_grad for p in head.parameters())
    assert all(torch.equal(p, frozen[n]) for n, p in target.named_parameters())


class RecordingEagle(AutoregressiveSpeculator):
    """Records (last committed position P, next token, drafts) of every drafting proposal of request 0."""

    def __init__(self, head: EagleHead, aux: tuple[int, ...]) -> None:
        super().__init__(head, num_spec_tokens=K, aux_layers=aux, name="eagle")
        self.seen: list[tuple[int, int, list[int]]] = []

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = super().propose(step, ctx)
        if step.drafting[0]:
            self.seen.append((step.base_positions[0], step.next_token_ids[0], proposal.draft_token_ids[0].tolist()))
        return proposal


def test_unrolled_training_forward_drafts_what_the_paged_eagle_path_drafts(
    target: Transformer, sequences: Tensor
) -> None:
    """Step j of the dense unroll, fed the engine's drafts, reproduces the engine's draft j at every proposal."""
    aux = spread_layers(target.config.num_layers)
    head = EagleHead(target, num_aux=len(aux), seed=1)
    train_eagle(head, target, sequences, TrainSchedule(steps=60, lr=1e-2), depth=K)
    spec = RecordingEagle(head, aux)
    engine = Engine(
        target, EngineConfig(num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_model_len=64)), speculator=spec
    )
    prompt = [5, 9, 2, 30]
    engine.add_request("r", prompt, max_tokens=16)
    tokens = torch.tensor(prompt + engine.run()["r"])
    feats = target_features(target, tokens[None], aux)
    assert len({tuple(d) for _, _, d in spec.seen}) > 3
    with torch.no_grad():
        fused = head.fuse_aux([a[0] for a in feats.aux])[None]
        for p, bonus, drafts in spec.seen:
            # prefill rows 0..P read x_{t+1}; row P reads the bonus. Later steps read the drafts themselves.
            rows = p + 1
            step_ids = [torch.cat([tokens[1:rows], torch.tensor([bonus])])[None]]
            for d in drafts[:-1]:
                step_ids.append(torch.cat([tokens[1:rows], torch.tensor([d])])[None])
            hidden = unrolled_hidden(head, fused[:, :rows], step_ids)
            got = [int(target.compute_logits(head.norm(h[0, -1:])).argmax()) for h in hidden]
            assert got == drafts, f"P {p}"


def test_target_features_round_trip_through_safetensors(target: Transformer, sequences: Tensor, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from backends.training.data import TargetFeatures

    feats = target_features(target, sequences[:3], (0, 1))
    path = tmp_path / "feats.safetensors"
    feats.save(path, {"model": "tiny"})
    loaded, meta = TargetFeatures.load(path)
    assert meta["model"] == "tiny"
    assert loaded.aux_layers == feats.aux_layers
    for name in ("tokens", "greedy_next", "top_ids", "top_probs"):
        assert torch.equal(getattr(loaded, name), getattr(feats, name))
    assert all(torch.equal(a, b) for a, b in zip(loaded.aux, feats.aux, strict=True))
    save_file({"tokens": feats.tokens}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(ValueError, match="not a TargetFeatures file"):
        TargetFeatures.load(tmp_path / "weights.safetensors")


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("steps", {"steps": 0}),
        ("lr", {"lr": 0.0}),
        ("lr", {"lr": float("nan")}),
        ("batch_size", {"batch_size": 0}),
        ("warmup", {"warmup": -1}),
        ("clip", {"clip": 0.0}),
        ("keep_top", {"keep_top": 0}),
        ("negatives", {"negatives": -1}),
    ],
)
def test_train_schedule_rejects_bad_settings_naming_the_field(field: str, bad: dict[str, Any]) -> None:
    settings: dict[str, Any] = {"steps": 10} | bad
    with pytest.raises(ValueError, match=rf"\b{field} must be"):
        TrainSchedule(**settings)


def test_train_schedule_reports_every_bad_field_and_keeps_the_old_defaults() -> None:
    with pytest.raises(ValueError, match=r"steps must be.*; lr must be"):
        TrainSchedule(steps=0, lr=0.0)
    assert TrainSchedule(steps=1) == TrainSchedule(
        steps=1, lr=3e-3, seed=0, batch_size=8, warmup=0, clip=None, autocast=None, keep_top=None, negatives=0
    )


@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(any),
    picks=st.lists(st.integers(0, 10**6), min_size=0, max_size=12),
)
@settings(max_examples=60, deadline=None)
def test_stacked_rows_read_as_the_concatenation(sizes: list[int], picks: list[int]) -> None:
    from backends.training.data import StackedRows

    parts = [torch.randn(n, 3, 2) for n in sizes]
    whole = torch.cat(parts)
    stacked = StackedRows(parts)
    index = torch.tensor([p % len(whole) for p in picks], dtype=torch.long)
    assert stacked.shape == whole.shape and len(stacked) == len(whole)
    assert torch.equal(stacked[index], whole[index])
    assert torch.equal(StackedRows([StackedRows(parts[:1]), *parts[1:]])[index], whole[index])
    assert torch.equal(stacked.contiguous(), whole)
    with pytest.raises(IndexError, match="out of range"):
        stacked[torch.tensor([len(whole)])]
    with pytest.raises(ValueError, match="one trailing shape"):
        StackedRows([torch.zeros(1, 3, 2), torch.zeros(1, 2, 3)])
