"""Shared helpers for tests (not a test module)."""

from __future__ import annotations

import torch

from specdec.nn.transformer import Transformer


def perturbed_copy(target: Transformer, scale: float, seed: int) -> Transformer:
    """The target with noise on its weights: agrees with it often but not always."""
    copy = Transformer(target.config, seed=target.seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
    return copy
