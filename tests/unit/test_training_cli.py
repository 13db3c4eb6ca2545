"""``python -m backends.training.cli``: a continued run keeps its history, and draft vocabularies reach the file.

On a tiny target (``specdec.hub.load`` replaced, so nothing is downloaded):
a short ``train`` run, a second one with ``--init`` from it and
``--draft-vocab``, and ``vocab`` on the first file. The drafter a factory
builds from each file must carry exactly the vocabulary the features give,
and ``vocab`` must leave the weights untouched.
"""

from __future__ import annotations

import json
import re
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


def test_several_feature_files_train_as_one_and_the_card_names_them_all(
    tiny: tuple[Transformer, Path], tmp_path: Path
) -> None:
    target, features = tiny
    more = tmp_path / "more.safetensors"
    seqs = generate_sequences(target, 5, prompt_len=4, gen_len=12, seed=1)
    extra = target_features(target, seqs, feature_layers(target.config.num_layers))
    extra.save(more, {"model": "tiny", "summary": json.dumps(["more: 5 windows"])})
    out = tmp_path / "both.safetensors"
    train(features, out, "--features", str(more))
    meta = read_metadata(out)
    assert json.loads(meta["training"])["sequences"] == 12 + 5
    assert json.loads(meta["data"]) == ["tiny: 12 windows", "more: 5 windows"]
    assert re.search(r"--features feats\.safetensors .*--features more\.safetensors", meta["command"])
    from backends.training.data import TargetFeatures

    joined = tmp_path / "joined.safetensors"  # the same windows in one file train to the same weights, bit for bit
    TargetFeatures.concat([TargetFeatures.load(p)[0] for p in (features, more)]).save(
        joined, {"model": "tiny", "summary": "[]"}
    )
    train(joined, tmp_path / "one.safetensors")
    one, two = load_file(str(tmp_path / "one.safetensors")), load_file(str(out))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    short = tmp_path / "short.safetensors"  # windows of another length cannot be batched with the others
    target_features(target, seqs[:, :8], feature_layers(target.config.num_layers)).save(
        short, {"model": "tiny", "summary": "[]"}
    )
    with pytest.raises(ValueError, match=r"features 1 has .*\(aux layers, window length.*16.*8"):
        train(features, tmp_path / "x.safetensors", "--features", str(short))

    other = tmp_path / "other.safetensors"  # features of another model: one line, before any model loads
    extra.save(other, {"model": "another-model", "summary": "[]"})
    args = ["train", "--backend", "dflash", "--features", str(features), "--features", str(other)]
    assert main([*args, "--out", str(tmp_path / "y.safetensors"), "--steps", "1"]) == 2


def test_features_sources_skip_and_explain_and_refuse_nothing(tmp_path: Path) -> None:
    import argparse

    from backends.training.cli import prompt_sets
    from specdec.corpora import code_explanation_prompts, code_instruction_prompts

    def args(**changes: object) -> argparse.Namespace:
        base = {"prompts_per_suite": 0, "code_prompts": 0, "code_skip": 0, "explain_prompts": 0}
        return argparse.Namespace(**{**base, **changes})

    assert prompt_sets(args()) == []
    skipped = prompt_sets(args(code_prompts=3, code_skip=5))
    assert skipped == [("stdlib code prompts from #5", code_instruction_prompts(limit=8)[5:])]
    assert prompt_sets(args(explain_prompts=2)) == [("stdlib explain prompts", code_explanation_prompts(limit=2))]
    assert [name for name, _ in prompt_sets(args(prompts_per_suite=1))] == [
        "humaneval (train split)",
        "mtbench (train split)",
        "shakespeare (train split)",
    ]
    nothing = ["features", "--model", "smollm2-135m-instruct", "--out", str(tmp_path / "f.safetensors")]
    assert main([*nothing, "--text-per-group", "0", "--prompts-per-suite", "0"]) == 2
