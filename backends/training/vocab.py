"""Which rows of the shared LM head a training loss is computed over.

The target's LM head (49,152 x 576 for SmolLM2) costs far more per row than a
drafter's own layer, so a CPU run scores each batch against the tokens the
data can ask for (every label and the target's top tokens anywhere in the
features) plus a fresh random sample of the other tokens, which keeps pushing
those down too (a sampled softmax). The default is the whole vocabulary: exact,
and what the tiny-target tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from backends.training.data import TargetFeatures
from specdec.nn.transformer import Transformer


@dataclass(frozen=True, eq=False)
class HeadRows:
    """The LM-head rows of one batch and where each vocabulary id sits among them."""

    ids: Int[Tensor, " rows"]
    weight: Float[Tensor, "rows hidden"]
    position: Int[Tensor, " vocab"]
    """Row of each vocabulary id, -1 for ids not among the rows."""

    def logits(self, normed: Float[Tensor, "n hidden"]) -> Float[Tensor, "n rows"]:
        return F.linear(normed, self.weight)

    def index(self, token_ids: Int[Tensor, "*shape"]) -> Int[Tensor, "*shape"]:
        """Rows of ``token_ids``; every id must be among the rows (the kept set covers the labels)."""
        rows = self.position[token_ids]
        if bool((rows < 0).any()):
            raise ValueError("a label is outside the LM-head rows of this batch; keep it in the vocabulary subset")
        return rows


class HeadSampler:
    """Full vocabulary (``keep=None``), or ``keep`` plus ``negatives`` fresh random other rows per batch."""

    def __init__(
        self,
        target: Transformer,
        keep: Int[Tensor, " kept"] | None = None,
        *,
        negatives: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        weight = target.lm_head_weight.detach()
        vocab = weight.shape[0]
        self.weight = weight if dtype is None else weight.to(dtype)
        self.vocab = vocab
        self.negatives = negatives
        device = weight.device
        if keep is None:
            self.keep = torch.arange(vocab, device=device)
        else:
            self.keep = keep.to(device).unique()
            if len(self.keep) and (int(self.keep.min()) < 0 or int(self.keep.max()) >= vocab):
                raise ValueError(f"kept token ids must lie in [0, {vocab})")
        others = torch.ones(vocab, dtype=torch.bool, device=device)
        others[self.keep] = False
        self.others = others.nonzero().squeeze(1)
        self.keep_weight = self.weight[self.keep]

    @property
    def full(self) -> bool:
        return len(self.keep) == self.vocab

    def rows(self, g: torch.Generator) -> HeadRows:
        """This batch's rows: the kept ones, then up to ``negatives`` others drawn from ``g``."""
        ids, weight = self.keep, self.keep_weight
        n = min(self.negatives, len(self.others))
        if n:
            pick = self.others[torch.randperm(len(self.others), generator=g)[:n].to(self.others.device)]
            ids = torch.cat([ids, pick])
            weight = torch.cat([weight, self.weight[pick]])
        position = torch.full((self.vocab,), -1, dtype=torch.long, device=ids.device)
        position[ids] = torch.arange(len(ids), device=ids.device)
        return HeadRows(ids, weight, position)


def head_sampler(
    target: Transformer,
    feats: TargetFeatures,
    *,
    keep_top: int | None,
    negatives: int = 0,
    dtype: torch.dtype | None = None,
) -> HeadSampler:
    """``keep_top=None``: the whole vocabulary. Else keep every token of the data and the target's top ``keep_top``."""
    if keep_top is None:
        return HeadSampler(target, dtype=dtype)
    if not 1 <= keep_top <= feats.top_ids.shape[-1]:
        raise ValueError(f"keep_top must be in [1, {feats.top_ids.shape[-1]}], got {keep_top}")
    keep = torch.cat([feats.tokens.flatten(), feats.top_ids[..., :keep_top].flatten()])
    return HeadSampler(target, keep, negatives=negatives, dtype=dtype)
