"""The heads: ``h + SiLU(W_k h)`` per head, projected by the target's own LM head (as Medusa does)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from specdec import DPGroup, Transformer


class MedusaHeads:
    """``num_heads`` residual heads over the target's hidden size, initialised from ``seed``.

    Untrained weights (small, so each head starts near the target's own next-token
    guess): drafting stays lossless, the verifier keeps only what the target
    agrees with; training them is what would make them fast.
    """

    def __init__(self, target: Transformer, num_heads: int, *, seed: int = 0, scale: float = 0.02) -> None:
        if num_heads < 1:
            raise ValueError(f"num_heads (K) must be >= 1, got {num_heads}")
        hidden = target.config.hidden_size
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(num_heads, hidden, hidden, generator=generator) * scale
        self.target = target
        self.num_heads = num_heads
        self.weight: Float[Tensor, "heads hidden hidden"] = weight.to(target.device)

    def __call__(
        self,
        hidden_states: Float[Tensor, "rows hidden"],
        *,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "rows heads vocab"]:
        del dp_group, num_tokens_across_dp  # no collectives: each row's heads are independent of the others
        h = hidden_states.float()
        x = h[:, None, :] + torch.nn.functional.silu(torch.einsum("rd,kud->rku", h, self.weight))
        rows, heads, hidden = x.shape
        logits = self.target.compute_logits(x.reshape(rows * heads, hidden).to(hidden_states.dtype))
        return logits.reshape(rows, heads, logits.shape[-1])
