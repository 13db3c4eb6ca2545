"""``python -m backends.training.cli``: a continued run keeps its history, and draft vocabularies reach the file.

On a tiny target (``specdec.hub.load`` replaced, so nothing is downloaded):
a short ``train`` run, a second one with ``--init`` from it and
``--draft-vocab``, and ``vocab`` on the first file. The drafter a factory
builds from each file must carry exactly the vocabulary the features give,
and ``vocab`` must leave the weights untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import specdec.hub
from backends.draft_vocab import most_frequent
from backends.pretrained import DRAFT_VOCAB, card_path, read_metadata, resolve
from backends.training import generate_sequences, target_features
from backends.training.cli import feature_layers, main
from specdec.backend_registry import create
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer

VOCAB = 32


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Transformer, Path]:
    target = Transformer(ModelConfig.tiny(vocab_size=VOCAB), seed=0)
    monkeypatch.setattr(specdec.hub, "load", lambda name, **_: (target, None))
    seqs = generate_sequences(target, 12, prompt_len=4, gen_len=12, seed=0)
    feats = target_features(target, seqs, feature_layers(target.config.num_layers))
    path = tmp_path / "feats.safetensors"
    feats.save(path, {"model": "tiny", "summary": json.dumps(["tiny: 12 windows"])})
    return target, path


def train(features: Path, out: Path, *extra: str) -> None:
    args = ["train", "--backend", "dflash", "--features", str(features), "--out", str(out), "--steps", "3"]
    assert main([*args, "--batch-size", "2", "--anchors", "4", "--k", "3", *extra]) == 0


def test_a_continued_run_records_its_start_and_ships_a_draft_vocabulary(
    tiny: tuple[Transformer, Path], tmp_path: Path
) -> None:
    target, features = tiny
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    train(features, first)
    train(features, second, "--init", str(first), "--draft-vocab", "10")

    training = json.loads(read_metadata(second)["training"])
    assert training["continued_from"]["file"] == first.name
    assert training["continued_from"]["training"]["steps"] == 3
    assert training["draft_vocab"]["size"] == 10
    labels = target_features(target, load_file(str(features))["tokens"], (0,)).greedy_next
    want = most_frequent(labels, 10, VOCAB).tolist()
    spec = create("dflash", target, num_spec_tokens=3, pretrained=second)
    assert spec.network.draft_vocab.ids.tolist() == want  # type: ignore[attr-defined]
    assert create("dflash", target, num_spec_tokens=3, pretrained=first).network.draft_vocab is None  # type: ignore[attr-defined]

    before = load_file(str(first))
    assert main(["vocab", "--features", str(features), "--file", str(first), "--size", "6"]) == 0
    after = load_file(str(first))
    assert after.pop(DRAFT_VOCAB).tolist() == most_frequent(labels, 6, VOCAB).tolist()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    meta = read_metadata(first)
    assert json.loads(meta["training"])["draft_vocab"]["size"] == 6 and " vocab " in meta["vocab_command"]
    assert json.loads(card_path(first).read_text(encoding="utf-8"))["vocab_command"] == meta["vocab_command"]
    for path in (first, second):  # files are named relative to the folder that holds them, never by machine path
        record = json.dumps(read_metadata(path)) + card_path(path).read_text(encoding="utf-8")
        assert str(tmp_path) not in record and str(Path.cwd()) not in record
    assert "--out second.safetensors" in read_metadata(second)["command"]
    assert "--init first.safetensors" in json.loads(card_path(second).read_text(encoding="utf-8"))["command"]
    assert resolve(first, "dflash") == first  # ``vocab`` rewrote the file and its card with it


def test_init_from_a_file_of_another_backend_is_refused(tiny: tuple[Transformer, Path], tmp_path: Path) -> None:
    _, features = tiny
    first = tmp_path / "dflash.safetensors"
    train(features, first)
    with pytest.raises(ValueError, match="does not fit"):
        main(["train", "--backend", "eagle", "--features", str(features), "--out", str(tmp_path / "e.safetensors"),
              "--steps", "2", "--batch-size", "2", "--init", str(first)])  # fmt: skip
