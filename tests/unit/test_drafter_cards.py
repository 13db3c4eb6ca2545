"""Drafter files carry a model card with their sha256, and shipped ones are verified against it on load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import backends.pretrained as pretrained
from backends import create
from backends.pretrained import DrafterIntegrityError, card_path, resolve, save_drafter, weights_path
from specdec.hub.manifest import sha256_file
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer

SHIPPED_MODEL = "smollm2-135m-instruct"


@pytest.fixture
def shipped_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the package's weights folder holding one freshly saved DFlash drafter of a tiny target."""
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    monkeypatch.setattr(pretrained, "_VERIFIED", set())
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    spec = create("dflash", target, num_spec_tokens=3, seed=7)
    meta = {"backend": "dflash", "model": "tiny", "network": {"aux_layers": list(spec.aux_layers), "num_layers": 1}}  # type: ignore[attr-defined]
    save_drafter(tmp_path / "tiny" / "dflash.safetensors", {"network": spec.network}, meta, dtype=torch.float32)  # type: ignore[attr-defined]
    return tmp_path


def test_saving_writes_a_card_and_resolving_a_shipped_file_verifies_it(shipped_dir: Path) -> None:
    path = shipped_dir / "tiny" / "dflash.safetensors"
    card = json.loads(card_path(path).read_text(encoding="utf-8"))
    assert card == {
        "backend": "dflash",
        "file": "dflash.safetensors",
        "model": "tiny",
        "sha256": sha256_file(path),
        "size_bytes": path.stat().st_size,
    }
    assert resolve("tiny", "dflash") == path
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    loaded = create("dflash", target, num_spec_tokens=3, pretrained="tiny")
    assert getattr(loaded, "weights_source", None) == "shipped:tiny/dflash"  # a name, never a machine path


def test_a_corrupted_shipped_file_is_refused_by_its_sha256(shipped_dir: Path) -> None:
    path = shipped_dir / "tiny" / "dflash.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight: same size, same metadata, still loads
    path.write_bytes(bytes(data))
    with pytest.raises(
        DrafterIntegrityError, match=r"dflash.safetensors has sha256 [0-9a-f]{64}, its model card records"
    ):
        resolve("tiny", "dflash")
    path.write_bytes(bytes(data[:-4]))
    with pytest.raises(
        DrafterIntegrityError, match=r"has \d+ bytes, its model card records \d+: the file is truncated"
    ):
        resolve("tiny", "dflash")


def test_a_shipped_file_without_a_card_is_refused_and_a_given_path_is_checked_only_with_one(shipped_dir: Path) -> None:
    path = shipped_dir / "tiny" / "dflash.safetensors"
    card_path(path).unlink()
    with pytest.raises(DrafterIntegrityError, match=r"dflash.safetensors has no model card \(dflash.card.json\)"):
        resolve("tiny", "dflash")
    assert resolve(path, "dflash") == path  # the user's own file, named by path: no card, nothing to check against
    card_path(path).write_text('{"sha256": "x"}', encoding="utf-8")
    with pytest.raises(DrafterIntegrityError, match="not a readable model card"):
        resolve(path, "dflash")


@pytest.mark.parametrize("backend", ["eagle", "dflash", "dspark"])
def test_every_shipped_drafter_matches_its_card(backend: str) -> None:
    path = weights_path(SHIPPED_MODEL, backend)
    card = json.loads(card_path(path).read_text(encoding="utf-8"))
    assert card["model"] == SHIPPED_MODEL and card["backend"] == backend and card["file"] == path.name
    assert card["sha256"] == sha256_file(path) and card["size_bytes"] == path.stat().st_size
    assert resolve(SHIPPED_MODEL, backend) == path
