"""Sampling parameters and the one logits → probabilities transform.

Lossless verification compares the target's distribution ``p`` with the
proposal ``q`` a draft token was drawn from, so both must be processed by the
same transform: drafters build their proposals with :func:`probabilities` and
the verifier builds ``p`` with it too. Any difference (say, top-p applied to the
target but not the draft) changes what "lossless" is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

__all__ = ["SamplingParams", "probabilities", "sample"]


class SamplingParams(BaseModel):
    """Per-request sampling settings; ``temperature == 0`` means greedy (argmax).

    Strict validation: ``top_k=True`` or ``temperature="1"`` are errors rather
    than silently coerced values. Seeding is the caller's (a ``torch.Generator``).
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=1)
    """Keep the k most likely tokens (ties at the k-th value are all kept); None keeps all."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Keep the smallest set of most likely tokens whose mass is >= top_p; None keeps all."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _per_row(params: SamplingParams | Sequence[SamplingParams], rows: int) -> Sequence[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * rows
    if len(params) != rows:
        raise ValueError(f"got {len(params)} SamplingParams for {rows} logits rows; pass one per row or one for all")
    return params


def probabilities(
    logits: Float[Tensor, "rows vocab"],
    params: SamplingParams | Sequence[SamplingParams],
) -> Float[Tensor, "rows vocab"]:
    """Temperature, then top-k, then top-p, then softmax; greedy rows become one-hot argmax.

    Returns float32 whatever the logits dtype, so the target's ``p`` and a
    drafter's ``q`` are compared at the same precision. Vectorised over rows and
    vocabulary; the only per-row Python work is reading the parameters.
    """
    rows, vocab = logits.shape
    per_row = _per_row(params, rows)
    device = logits.device
    x = logits.float()
    greedy_rows = [p.greedy for p in per_row]
    if all(greedy_rows):
        return torch.nn.functional.one_hot(x.argmax(dim=-1), vocab).to(torch.float32)

    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in per_row], dtype=torch.float32, device=device)
    # Shifting by the row max changes neither softmax nor top-k/top-p and keeps a
    # tiny temperature from overflowing to inf (inf - inf would be NaN).
    scaled = (x - x.amax(dim=-1, keepdim=True)) / temps[:, None]

    use_top_k = any(p.top_k is not None and p.top_k < vocab for p in per_row)
    use_top_p = any(p.top_p is not None and p.top_p < 1.0 for p in per_row)
    if use_top_k or use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            k = torch.tensor([min(p.top_k or vocab, vocab) for p in per_row], dtype=torch.long, device=device)
            kth = sorted_logits.gather(-1, (k - 1)[:, None])
            keep &= sorted_logits >= kth
        if use_top_p:
            top_p = torch.tensor([p.top_p if p.top_p is not None else 1.0 for p in per_row], device=device)
            probs_sorted = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            # A token is kept while the mass strictly before it is still short of top_p:
            # that is the smallest prefix whose mass reaches top_p. top_p == 1 keeps all.
            keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep[:, 0] = True
        keep_vocab = torch.empty_like(keep).scatter_(-1, order, keep)
        scaled = scaled.masked_fill(~keep_vocab, float("-inf"))

    out = scaled.softmax(dim=-1)
    if any(greedy_rows):
        greedy = torch.tensor(greedy_rows, device=device)
        one_hot = torch.nn.functional.one_hot(x.argmax(dim=-1), vocab).to(torch.float32)
        out = torch.where(greedy[:, None], one_hot, out)
    return out


def sample(probs: Float[Tensor, "rows vocab"], generator: torch.Generator | None = None) -> Int[Tensor, " rows"]:
    """One token per row; raises on a row that is not a distribution (negative, NaN, all zero)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
