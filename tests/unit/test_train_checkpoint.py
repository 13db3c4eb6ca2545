"""A drafter run cut short and resumed from its checkpoint ends with the weights of a run never interrupted."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import Tensor

from backends.dflash import DFlashNetwork
from backends.dspark import DSparkHeads
from backends.registry import spread_layers
from backends.training import TrainSchedule, generate_sequences, train_dspark
from backends.training.checkpoint import TrainCheckpoint
from backends.training.cli import train_checkpoint
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer

K = 3
STEPS = 7
SCHEDULE = TrainSchedule(steps=STEPS, lr=1e-2, warmup=2, clip=1.0, batch_size=4, keep_top=8, negatives=4)


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(vocab_size=32), seed=0)


def build(target: Transformer) -> tuple[DFlashNetwork, DSparkHeads]:
    c = target.config
    aux = spread_layers(c.num_layers, count=5)
    return DFlashNetwork(target, num_aux=len(aux), seed=1), DSparkHeads(c.hidden_size, c.vocab_size, seed=1)


def weights(*modules: torch.nn.Module) -> list[Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_a_resumed_run_ends_with_the_weights_and_losses_of_an_uninterrupted_one(
    target: Transformer, tmp_path: Path
) -> None:
    data = generate_sequences(target, 12, prompt_len=4, gen_len=20, seed=0)
    network, heads = build(target)
    straight = train_dspark(network, heads, target, data, SCHEDULE, block_size=K)
    expected = weights(network, heads)

    path = tmp_path / "run.checkpoint.safetensors"

    def stop_at(step: int, loss: float) -> None:
        if step == 5:
            raise Interrupted

    network, heads = build(target)
    with pytest.raises(Interrupted):
        first = TrainCheckpoint(path, every=2, identity={"run": "a"})
        train_dspark(network, heads, target, data, SCHEDULE, block_size=K, on_step=stop_at, checkpoint=first)
    assert path.is_file() and not path.with_name(path.name + ".partial").exists()

    network, heads = build(target)  # a fresh process: initial weights again, state only from the file
    second = TrainCheckpoint(path, every=2, identity={"run": "a"})
    resumed = train_dspark(network, heads, target, data, SCHEDULE, block_size=K, checkpoint=second)
    assert resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(weights(network, heads), expected, strict=True))
    assert second.wall_s() > 0


def test_the_checkpoint_of_another_run_is_refused_naming_what_differs(target: Transformer, tmp_path: Path) -> None:
    data = generate_sequences(target, 4, prompt_len=4, gen_len=12, seed=0)
    path = tmp_path / "c.safetensors"
    network, heads = build(target)
    schedule = TrainSchedule(steps=3, lr=1e-2, batch_size=2)
    train_dspark(
        network,
        heads,
        target,
        data,
        schedule,
        block_size=K,
        checkpoint=TrainCheckpoint(path, every=1, identity={"lr": 1}),
    )
    other = TrainCheckpoint(path, every=1, identity={"lr": 2})
    with pytest.raises(ValueError, match=r"checkpoint of another run.*differs in lr"):
        train_dspark(*build(target), target, data, schedule, block_size=K, checkpoint=other)
    with pytest.raises(ValueError, match=">= 1 step"):
        TrainCheckpoint(path, every=0, identity={})


def test_the_cli_identifies_a_run_by_what_it_computes_not_where_it_writes() -> None:
    def args(**changes: object) -> argparse.Namespace:
        base = {
            "backend": "dspark",
            "features": ["v4/feats.safetensors"],
            "out": "v4/dspark.safetensors",
            "steps": 100,
            "lr": 1e-3,
            "init": "dspark.safetensors",
            "threads": 1,
            "log_every": 10,
            "losses": None,
            "checkpoint": None,
            "checkpoint_every": 50,
        }
        return argparse.Namespace(**{**base, **changes})

    one = train_checkpoint(args())
    assert one.path == Path("v4/dspark.checkpoint.safetensors") and one.every == 50
    assert one.identity == train_checkpoint(args(out="elsewhere/x.safetensors", threads=2, log_every=1)).identity
    assert one.identity["features"] == "feats.safetensors"
    both = train_checkpoint(args(features=["v4/feats.safetensors", "v7/more.safetensors"])).identity["features"]
    assert both == ["feats.safetensors", "more.safetensors"]  # several files: a new stage's data is another run
    assert both != train_checkpoint(args(features=["v7/more.safetensors", "v4/feats.safetensors"])).identity["features"]
    assert one.identity != train_checkpoint(args(lr=2e-3)).identity
    assert one.identity != train_checkpoint(args(steps=200)).identity
    assert train_checkpoint(args(checkpoint_every=0)) is None
    assert train_checkpoint(args(checkpoint="c.safetensors")).path == Path("c.safetensors")
