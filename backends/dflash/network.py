"""The DFlash draft network: KV injection of fused target features, then one bidirectional block pass.

Target hidden states of several layers are concatenated and projected
(linear + RMSNorm) to the draft width; every draft layer turns that feature
into context K/V with its own ``k_proj``/``v_proj`` ("KV injection", written to
the draft cache for committed tokens only). Queries come only from block
tokens ``[bonus, MASK x (q-1)]``; each block query attends to the cached
context before the block plus the block's own K/V, which are computed in the
step and never cached. The embedding and LM head are the target's (shared,
frozen); the MASK embedding is the drafter's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from backends.draft_vocab import DraftVocab, head_logits
from contracts import AttentionMetadata
from specdec.dp_group import DPGroup
from specdec.kv_storage import PagedKVStorage
from specdec.nn.attention import validate_attention_inputs, write_kv
from specdec.nn.config import ModelConfig
from specdec.nn.layers import Linear, RMSNorm, WeightInit, apply_rope
from specdec.nn.packed_linear import DRAFTER_ROW_CHUNK, PackedLinear, set_row_chunk
from specdec.nn.transformer import DecoderLayer, SelfAttention, Transformer
from specdec.speculator import DraftOutput, rows_to_score

MASK_TOKEN_ID = -2
"""Input id of a MASK row; it selects the drafter's learned MASK embedding (not a vocabulary entry)."""


def block_attention(
    q: Float[Tensor, "rows heads head_dim"],
    block_k: Float[Tensor, "rows kv_heads head_dim"],
    block_v: Float[Tensor, "rows kv_heads head_dim"],
    meta: AttentionMetadata,
    kv: PagedKVStorage,
    layer: int,
    context_lens: Sequence[int],
) -> Float[Tensor, "rows heads head_dim"]:
    """Each block query sees its request's cached context ``[0, context_lens[r])`` plus the whole block.

    The block K/V are concatenated here instead of being written to the cache
    and rolled back, so the draft cache only ever holds committed context.
    Requests with one query length (every drafting request: a block is K + 1
    rows) share one masked call over their contexts padded to the longest; a
    call per request cost 1.8 ms of a 7 ms proposal at batch 8. Validates like
    a kernel first (``q.shape[0]`` vs ``qo_indptr[-1]``).
    """
    qsl = validate_attention_inputs(q, meta)
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    by_len: dict[int, list[int]] = {}
    for r in range(meta.num_reqs):
        if qsl[r + 1] > qsl[r]:
            by_len.setdefault(qsl[r + 1] - qsl[r], []).append(r)
    for query_len, reqs in by_len.items():
        n, device = len(reqs), q.device
        rows = torch.tensor([i for r in reqs for i in range(qsl[r], qsl[r + 1])], dtype=torch.int64, device=device)
        lens = [context_lens[r] for r in reqs]
        width = max(lens)
        table = meta.block_table.index_select(0, torch.tensor(reqs, dtype=torch.int64, device=device))
        ctx_k, ctx_v = kv.gather_slots(layer, kv.slot_table(table, lens, width))
        shape = (n, query_len, kv.num_kv_heads, head_dim)
        keys = torch.cat([ctx_k, block_k.index_select(0, rows).view(shape)], dim=1).transpose(1, 2)
        values = torch.cat([ctx_v, block_v.index_select(0, rows).view(shape)], dim=1).transpose(1, 2)
        # Context positions past a request's own length read the null slot and are masked; its block is all seen.
        context = torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        allowed = torch.cat([context, context.new_ones(n, query_len)], dim=1)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=device).masked_fill_(~allowed, float("-inf"))
        queries = q.index_select(0, rows).view(n, query_len, heads, head_dim).transpose(1, 2)
        # Scores and softmax accumulate in float32 inside the kernel, as in the target's attention.
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=bias[:, None, None, :], scale=1.0 / math.sqrt(head_dim), enable_gqa=True
        )
        out.index_copy_(0, rows, attended.transpose(1, 2).reshape(n * query_len, heads, head_dim))
    return out


def context_kv(
    attn: SelfAttention,
    feature: Float[Tensor, "ctx hidden"],
    positions: Int[Tensor, " ctx"],
    packed: PackedLinear | None = None,
) -> tuple[Float[Tensor, "ctx kv_heads head_dim"], Float[Tensor, "ctx kv_heads head_dim"]]:
    """One layer's injected K (rotated at the context positions) and V from the fused target feature.

    With ``packed``, K and V come from one matmul over both weights (an
    inference step's path); without, from the two projections (training's).
    """
    n = feature.shape[0]
    if packed is None:
        k, v = attn.k_proj(feature), attn.v_proj(feature)
    else:
        k, v = packed.run(feature, (attn.k_proj.weight, attn.v_proj.weight))
    k = k.reshape(n, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
    return apply_rope(k, positions, attn.rope_theta), v


class DFlashNetwork(nn.Module):
    """Feature fusion, a MASK embedding and a few decoder layers whose attention is a block attention.

    ``echo`` is test-only: every block row's output is replaced by its bonus
    row's embedding, so the shared LM head proposes what it reads off the bonus
    token alone. It stands in for a trained drafter in tests that need drafts
    a target sometimes accepts; no real DFlash checkpoint behaves like this.
    """

    def __init__(
        self,
        target: Transformer,
        *,
        num_aux: int,
        seed: int,
        num_layers: int = 1,
        layer_config: ModelConfig | None = None,
        echo: bool = False,
    ) -> None:
        super().__init__()
        hidden = target.config.hidden_size
        config = layer_config or target.config.model_copy(update={"num_layers": num_layers})
        if config.hidden_size != hidden or config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"a DFlash drafter shares the target's width and vocabulary: got hidden {config.hidden_size} "
                f"(target {hidden}), vocab {config.vocab_size} (target {target.config.vocab_size})"
            )
        if config.indexer is not None:
            raise ValueError("DFlash block attention is dense; a sparse indexer is not supported")
        init = WeightInit(seed, target.dtype, target.device)
        self.config = config
        self.num_aux = num_aux
        self.echo = echo
        self.fc = Linear(num_aux * hidden, hidden, init, "fc")
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, init, "hidden_norm")
        self.mask_embedding = init.parameter("mask_embedding", (hidden,), 1.0)
        self.layers = nn.ModuleList(DecoderLayer(config, init, i) for i in range(config.num_layers))
        self._context_kv = [PackedLinear() for _ in range(config.num_layers)]
        """Each layer's context K and V projections as one matrix: one matmul per layer per context write."""
        self.norm = RMSNorm(hidden, config.rms_norm_eps, init, "norm")
        self._target = [target]  # shared, frozen; a list keeps it out of this module's parameters
        self.draft_vocab: DraftVocab | None = None
        """The LM-head rows drafts are scored over (``None``: all); set by the factory from a trained file."""

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def head_logits(self, normed: Float[Tensor, "rows hidden"]) -> Float[Tensor, "rows vocab"]:
        return head_logits(self.target, self.draft_vocab, normed)

    def prepare_packed(self) -> None:
        """Pack the drafter's weights and cut its draft vocabulary's sub-head once, when it is bound to an engine."""
        self.fc.prepare_packed()
        for layer, packed in zip(self.decoder_layers(), self._context_kv, strict=True):
            layer.prepare_packed()
            packed.prepare((layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight))
        if self.draft_vocab is not None:
            self.draft_vocab.prepare(self.target)
        set_row_chunk(self, DRAFTER_ROW_CHUNK)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def make_kv_storage(self, num_blocks: int, block_size: int) -> PagedKVStorage:
        c = self.config
        return PagedKVStorage(
            c.num_layers,
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.target.dtype,
            device=self.target.device,
        )

    # -- KV injection ------------------------------------------------------------------------------

    def fuse(self, aux: Sequence[Float[Tensor, "ctx hidden"]]) -> Float[Tensor, "ctx hidden"]:
        """``RMSNorm(fc([h_l1; ...; h_ln]))``: the target context in the draft width."""
        if len(aux) != self.num_aux:
            raise ValueError(f"DFlash fuses {self.num_aux} target layers, got {len(aux)}")
        fused: Tensor = self.hidden_norm(self.fc(torch.cat(list(aux), dim=-1)))
        return fused

    def inject_context(
        self,
        aux: Sequence[Float[Tensor, "ctx hidden"]],
        positions: Int[Tensor, " ctx"],
        slot_mapping: Int[Tensor, " ctx"],
        kv: PagedKVStorage,
    ) -> None:
        """Write every layer's context K/V of the target rows; ``PAD_SLOT_ID`` rows (rejected, padded) are dropped."""
        feature = self.fuse(aux)
        for layer, packed in zip(self.decoder_layers(), self._context_kv, strict=True):
            k, v = context_kv(layer.self_attn, feature, positions, packed)
            kv.write(layer.self_attn.layer, slot_mapping, k, v)

    # -- the block forward -------------------------------------------------------------------------

    def embed_block(self, input_ids: Int[Tensor, " num_tokens"]) -> Float[Tensor, "num_tokens hidden"]:
        """Target embeddings for real tokens, the drafter's MASK vector for ``MASK_TOKEN_ID`` rows."""
        is_mask = input_ids == MASK_TOKEN_ID
        x = self.target.embed(input_ids.clamp(min=0))
        return torch.where(is_mask[:, None], self.mask_embedding.to(x.dtype)[None, :], x)

    def forward(
        self,
        input_ids: Int[Tensor, " num_tokens"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        *,
        features: Float[Tensor, "num_tokens feat"] | None,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
        context_lens: Sequence[int] | None = None,
        scored_rows: Sequence[int] | None = None,
    ) -> DraftOutput:
        """One block pass over ``desc.num_tokens`` model rows; attention over ``meta.num_tokens_padded`` rows.

        ``context_lens`` (committed tokens per drafting request) is host data the
        scheduler knows; without it they are read off the block's first
        positions, a device-to-host copy (a sync on a GPU).
        """
        del features  # DFlash's context arrives through the cache (KV injection), not per row
        q_width = meta.query_width or 1
        if context_lens is None:
            starts = torch.arange(meta.num_reqs, device=positions.device) * q_width
            # The bonus sits right after the committed context, never clamped: a drafting request has room for it.
            context_lens = [int(p) for p in positions[starts].tolist()]
        x0 = self.embed_block(input_ids)
        x = x0
        for layer in self.decoder_layers():
            x = self._layer(layer, x, positions, meta, kv, context_lens, dp_group, num_tokens_across_dp)
        if self.echo:
            x = self._echo(x, x0, meta.num_reqs, q_width)
        x = rows_to_score(x, scored_rows)
        return DraftOutput(x, self.head_logits(self.norm(x)))

    @staticmethod
    def _layer(
        layer: DecoderLayer,
        x: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        context_lens: Sequence[int],
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        """A pre-norm decoder layer whose attention is ``block_attention``; the MLP (or MoE) runs every model row."""
        attn = layer.self_attn
        n = x.shape[0]
        q, k, v = attn.project(layer.input_layernorm(x), positions)
        write_kv(kv, attn.layer, meta, k, v)  # every slot is PAD_SLOT_ID: checks the row count, caches nothing
        rows = meta.num_tokens_padded
        out = torch.zeros_like(q)
        out[:rows] = block_attention(q[:rows], k[:rows], v[:rows], meta, kv, attn.layer, context_lens)
        x = x + attn.o_proj(out.view(n, attn.num_heads * attn.head_dim))
        return layer.run_mlp(x, dp_group, num_tokens_across_dp)

    @staticmethod
    def _echo(
        x: Float[Tensor, "num_tokens hidden"], x0: Float[Tensor, "num_tokens hidden"], num_reqs: int, q: int
    ) -> Float[Tensor, "num_tokens hidden"]:
        rows = num_reqs * q
        bonus_rows = torch.arange(rows, device=x.device) // q * q
        out = x.clone()
        out[:rows] = x0[bonus_rows]
        return out
