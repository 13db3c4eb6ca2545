"""Models given by path rather than by catalog name: a GGUF file, or a Hugging Face checkpoint directory.

A GGUF file goes through the store like a catalog model, under a name derived
from its file name and sha256, so it is converted once and verified on every
load like any other cache. A checkpoint directory (``config.json``,
``tokenizer.json``, safetensors weights, optionally ``tokenizer_config.json``
and ``generation_config.json``) is already in the converted layout and is read
in place; it is the user's own directory, so nothing is copied or written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from specdec.hub.catalog import FileSource, ModelSpec
from specdec.hub.errors import ModelStoreError
from specdec.hub.manifest import sha256_file

CHECKPOINT_FILES = ("config.json", "tokenizer.json")
SINGLE_WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def is_path(model: str | Path) -> bool:
    """Whether ``model`` names a path (catalog names never contain a separator or end in ``.gguf``)."""
    text = str(model)
    return isinstance(model, Path) or "/" in text or text.endswith(".gguf") or text in (".", "..")


def gguf_spec(path: Path) -> ModelSpec:
    """A store entry for a GGUF on disk, named ``local-<stem>-<sha256 prefix>`` so each file has its own cache."""
    if not path.is_file():
        raise ModelStoreError(f"{path} does not exist or is not a file")
    digest = sha256_file(path)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip(".-") or "model"
    return ModelSpec(f"local-{stem}-{digest[:12]}", FileSource(path), digest, f"the GGUF file {path.name}", "unknown")


def checkpoint_problems(path: Path) -> list[str]:
    """Why ``path`` is not a checkpoint directory this loader reads (empty when it is)."""
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if not (path / SINGLE_WEIGHTS).is_file() and not (path / SHARD_INDEX).is_file():
        missing.append(f"{SINGLE_WEIGHTS} or {SHARD_INDEX}")
    return [f"it has no {name}" for name in missing]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelStoreError(f"cannot read {path.name} in {path.parent}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelStoreError(f"{path.name} in {path.parent} is not a JSON object")
    return data


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint (every shard the index names)."""
    if (path / SINGLE_WEIGHTS).is_file():
        return safetensors.torch.load_file(str(path / SINGLE_WEIGHTS))
    weight_map = read_json(path / SHARD_INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelStoreError(f"{SHARD_INDEX} in {path} has no weight_map")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise ModelStoreError(f"{SHARD_INDEX} in {path} names the shard {shard}, which is missing")
        state.update(safetensors.torch.load_file(str(path / shard)))
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise ModelStoreError(f"the shards in {path} lack {len(absent)} tensors the index names, e.g. {absent[:3]}")
    return state


def checkpoint_tokenizer_config(path: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` with special tokens as plain strings, plus stop ids from the generation config.

    Hugging Face writes special tokens either as strings or as serialized
    ``AddedToken`` objects; the chat template may also live in ``chat_template.jinja``.
    The stop ids are the generation config's ``eos_token_id`` (one id or a list),
    else the tokenizer's EOS.
    """
    config = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, Mapping):
            config[key] = value.get("content")
    if "chat_template" not in config and (path / "chat_template.jinja").is_file():
        config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    generation = read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    eos = generation.get("eos_token_id")
    if isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
        config["stop_token_ids"] = [eos] if isinstance(eos, int) else list(eos)
    elif config.get("eos_token") is None and "stop_token_ids" not in config:
        config["stop_token_ids"] = []  # nothing says when to stop: generation runs to max_tokens
    return config
