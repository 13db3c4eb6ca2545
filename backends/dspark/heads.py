"""The two small DSpark heads on top of the DFlash backbone.

Markov head: a low-rank transition bias ``W2 · W1[x_{k-1}]`` added to the
backbone logits of slot k, so each draft depends on the one before it (the
backbone alone drafts every slot independently). Confidence head:
``c_k = sigmoid(w · [h_k; W1 x_{k-1}] + b)`` estimates P(draft k accepted |
drafts before it accepted); its running product is the survival the
scheduler uses to pick per-request draft capacities.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn


class DSparkHeads(nn.Module):
    """Markov transition bias (rank ``rank``) and confidence head; random init stands in for trained weights."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        rank: int = 8,
        seed: int = 0,
        markov_scale: float = 1.0,
        confidence_scale: float = 1.0,
        confidence_bias: float = 0.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"the Markov head's rank must be >= 1, got {rank}")
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.rank = rank
        self.vocab_size = vocab_size
        # W1[x] @ W2.T has per-entry std ~= markov_scale: W1 ~ N(0, 1), W2 ~ N(0, markov_scale^2 / rank).
        self.w1 = nn.Parameter(torch.randn(vocab_size, rank, generator=g).to(dtype=dtype, device=device))
        w2 = torch.randn(vocab_size, rank, generator=g) * (markov_scale / math.sqrt(rank))
        self.w2 = nn.Parameter(w2.to(dtype=dtype, device=device))
        w = torch.randn(hidden_size + rank, generator=g) * (confidence_scale / math.sqrt(hidden_size + rank))
        self.conf_w = nn.Parameter(w.to(dtype=dtype, device=device))
        self.conf_b = nn.Parameter(torch.tensor(confidence_bias, dtype=dtype, device=device))

    def embed_prev(self, prev: Int[Tensor, " n"]) -> Float[Tensor, "n rank"]:
        """``W1[x_{k-1}]``: the low-rank code of the previous token, shared by both heads."""
        return self.w1[prev]

    def markov_bias(self, prev: Int[Tensor, " n"]) -> Float[Tensor, "n vocab"]:
        """``W2 · W1[x_{k-1}]``: the transition bias added to the backbone logits of the next slot."""
        return self.embed_prev(prev) @ self.w2.T

    def confidence(self, hidden: Float[Tensor, "n hidden"], prev: Int[Tensor, " n"]) -> Float[Tensor, " n"]:
        """``sigmoid(w · [h_k; W1 x_{k-1}] + b)``; depends on drafts before slot k only, never on draft k."""
        features = torch.cat([hidden.to(self.conf_w.dtype), self.embed_prev(prev)], dim=-1)
        return torch.sigmoid(features @ self.conf_w + self.conf_b)
