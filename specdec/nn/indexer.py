"""Sparse indexer in the style of DeepSeek-V3.2's lightning indexer: pick the top-k context positions per query.

Only decode-shaped batches are indexed (every real request has exactly one
query, ``meta.max_query_len == 1``). DeepSeek's decode path feeds the index
queries to a paged kernel that wants them as ``[batch, next_n, heads,
head_dim]`` and gets that layout with a plain reshape,
``q.view(num_reqs_padded, -1, heads, head_dim)``: one row per request row. The
reshape trusts the metadata: it is only right when the attention rows are
exactly one per request row. Batches with longer queries (prefill, verify,
block drafters) take DeepSeek's ragged prefill path instead; this reference
runs them dense, which keeps prefill exact and the indexer small.

Reproducing that reshape exactly is the point: with 12 requests and 13
attention rows (the DP pad leaked into draft metadata) it fails as in the
motivating crash, ``shape '[12, -1, 64, 128]' is invalid for input of size
106496``.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from contracts import AttentionMetadata
from specdec.kv_storage import PagedKVStorage
from specdec.nn.attention import host_seq_lens
from specdec.nn.config import IndexerConfig
from specdec.nn.layers import Linear, WeightInit


class SparseIndexer(nn.Module):
    """Scores cached positions for each decode query and keeps the ``topk`` best.

    Index keys are a cheap projection of the layer's cached (rotated) keys, so
    nothing extra is cached; the score of position ``s`` for a query is
    ``sum_j w_j * relu(q_j . k_s) / sqrt(head_dim)`` over index heads ``j``
    with per-token head weights ``w`` (DeepSeek's formula). With
    ``topk >= seq_len`` every position is kept and attention is exactly dense.
    """

    def __init__(
        self,
        config: IndexerConfig,
        hidden_size: int,
        kv_width: int,
        init: WeightInit,
        name: str,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.topk = config.topk
        self.wq = Linear(hidden_size, config.num_heads * config.head_dim, init, f"{name}.wq")
        self.wk = Linear(kv_width, config.head_dim, init, f"{name}.wk")
        self.weights_proj = Linear(hidden_size, config.num_heads, init, f"{name}.weights_proj")

    @staticmethod
    def applies_to(meta: AttentionMetadata) -> bool:
        """Decode-shaped: at least one real request, each with exactly one query."""
        return meta.num_reqs > 0 and meta.max_query_len == 1

    def forward(
        self,
        hidden: Float[Tensor, "rows hidden"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        layer: int,
    ) -> Bool[Tensor, "num_reqs_padded max_seq"]:
        """Top-k position mask per request row (padded rows select nothing), from the attention-input rows."""
        q_flat = self.wq(hidden)
        # The production reshape, on purpose without a guard: the metadata's row counts decide whether it works.
        q_idx = q_flat.view(meta.num_reqs_padded, -1, self.num_heads, self.head_dim)
        if q_idx.shape[1] != 1:
            raise ValueError(
                f"decode-shaped indexer got {hidden.shape[0]} attention rows for {meta.num_reqs_padded} request rows "
                f"(view {tuple(q_idx.shape)}); a decode step has exactly one query row per request row"
            )
        head_weights = self.weights_proj(hidden).view(meta.num_reqs_padded, self.num_heads) / math.sqrt(self.num_heads)
        seq_lens = host_seq_lens(meta)
        max_seq = max(seq_lens[: meta.num_reqs], default=0)
        mask = torch.zeros((meta.num_reqs_padded, max_seq), dtype=torch.bool, device=hidden.device)
        for r in range(meta.num_reqs):
            seq_len = seq_lens[r]
            if seq_len == 0:
                continue
            keys, _ = kv.gather(layer, meta.block_table[r], seq_len)
            index_keys = self.wk(keys.reshape(seq_len, -1))
            logits = torch.relu(torch.einsum("hd,sd->hs", q_idx[r, 0], index_keys)) / math.sqrt(self.head_dim)
            scores = (head_weights[r][:, None] * logits).sum(dim=0)
            keep = torch.topk(scores, min(self.topk, seq_len)).indices
            mask[r, keep] = True
        return mask
