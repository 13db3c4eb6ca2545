"""Mixture-of-experts MLP with expert-parallel dispatch over the DP group.

Expert parallelism is why DP ranks pad their batches: every rank's tokens are
all-gathered with an equal-size collective, each rank runs the experts it owns
on all of them, and the partial outputs are gathered back and summed. An
equal-size collective needs the same row count on every rank, so model inputs
carry the DP pad (``desc.num_tokens``), while attention, which is local, must
not (AR-5, BLK-3). Under eager DP, where ranks run their own unpadded counts,
this layer pads to the largest count itself and cuts back afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from specdec.dp_group import DPGroup
from specdec.nn.config import MoEConfig
from specdec.nn.layers import Linear, SwiGLUMLP, WeightInit


class MoEMLP(nn.Module):
    """Top-k softmax router over SwiGLU experts; expert ``e`` lives on DP rank ``e % dp_size``."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        intermediate_size: int,
        init: WeightInit,
        name: str,
        layer: int,
    ) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.layer = layer
        self.gate = Linear(hidden_size, config.num_experts, init, f"{name}.gate")
        self.experts = nn.ModuleList(
            SwiGLUMLP(hidden_size, intermediate_size, init, f"{name}.experts.{e}") for e in range(config.num_experts)
        )

    def owned_experts(self, rank: int, dp_size: int) -> list[int]:
        """Round-robin placement, so every rank owns experts while there are at least as many experts as ranks."""
        return [e for e in range(self.num_experts) if e % dp_size == rank]

    def route(
        self, x: Float[Tensor, "num_tokens hidden"]
    ) -> tuple[Float[Tensor, "num_tokens top_k"], Int[Tensor, "num_tokens top_k"]]:
        """Top-k experts per token and their weights (softmax over all experts, renormalised over the k)."""
        probs = torch.softmax(self.gate(x).to(torch.float32), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def local_experts(
        self, x: Float[Tensor, "num_tokens hidden"], experts: Sequence[int]
    ) -> Float[Tensor, "num_tokens hidden"]:
        """The summed, gate-weighted output of ``experts`` on every row (zero where none of them is routed)."""
        weights, chosen_ids = self.route(x)
        out = torch.zeros_like(x)
        for e in experts:
            hit = chosen_ids == e  # [num_tokens, top_k]; an expert appears at most once per row
            rows = hit.any(dim=-1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            gate = (weights * hit.to(weights.dtype)).sum(dim=-1)[rows]
            out[rows] += gate[:, None] * self.experts[e](x[rows])
        return out

    def forward(
        self,
        x: Float[Tensor, "num_tokens hidden"],
        *,
        dp_group: DPGroup | None = None,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        """All experts locally without a group; otherwise gather, run own experts, gather partials and sum."""
        if dp_group is None:
            if num_tokens_across_dp is not None and len(num_tokens_across_dp) != 1:
                raise ValueError(
                    f"num_tokens_across_dp={list(num_tokens_across_dp)} describes a DP world but no dp_group was given"
                )
            return self.local_experts(x, range(self.num_experts))
        rank, size = dp_group.rank, dp_group.size
        rows = x.shape[0]
        padded_rows = rows
        if num_tokens_across_dp is not None:
            counts = list(num_tokens_across_dp)
            if len(counts) != size or counts[rank] != rows:
                raise ValueError(
                    f"DP rank {rank}: num_tokens_across_dp={counts} does not describe this rank's {rows} rows "
                    f"in a world of {size}"
                )
            padded_rows = max(counts)
        if padded_rows > rows:  # eager DP: ranks run their own counts; the collective needs equal sizes
            x = torch.cat([x, x.new_zeros((padded_rows - rows, x.shape[1]))])
        everyone = dp_group.all_gather_equal(x, name=f"moe.layer{self.layer}.dispatch")
        partial = self.local_experts(everyone, self.owned_experts(rank, size))
        partials = dp_group.all_gather_equal(partial, name=f"moe.layer{self.layer}.combine")
        combined = partials.view(size, everyone.shape[0], x.shape[1]).sum(dim=0)
        return combined[rank * padded_rows : rank * padded_rows + rows]
