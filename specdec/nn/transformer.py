"""The reference Llama-style transformer, run over the paged KV cache with ``AttentionMetadata``.

Row counts follow the padding rules of ``docs/concepts.md``. The model runs ``input_ids.shape[0]`` rows (the
descriptor's ``num_tokens``: real tokens plus CUDA-graph and DP padding); every
row goes through the projections and the MLP (an MoE needs every rank's rows,
pads included) and writes its K/V through ``meta.slot_mapping`` (padded rows
hold ``PAD_SLOT_ID`` and are dropped). Attention runs on the first
``meta.num_tokens_padded`` rows only; rows past them get zeros from attention.

Parameter names are Hugging Face Llama's (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), so a checkpoint's state dict loads with ``load_hf_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from contracts import AttentionMetadata
from specdec.dp_group import DPGroup
from specdec.kv_storage import PagedKVStorage
from specdec.nn.attention import (
    AttentionPlan,
    check_slot_mapping,
    host_query_start_loc,
    paged_attention,
    query_rows_metadata,
    write_kv,
)
from specdec.nn.config import ModelConfig
from specdec.nn.indexer import SparseIndexer
from specdec.nn.layers import Linear, RMSNorm, SwiGLUMLP, WeightInit
from specdec.nn.moe import MoEMLP
from specdec.nn.packed_linear import ROW_INVARIANT_ROWS, PackedLinear, mkldnn_bf16_available, set_row_chunk


@dataclass(frozen=True, eq=False)
class ModelOutput:
    """Final-norm hidden states of every model row, and the outputs of the requested decoder layers."""

    hidden_states: Float[Tensor, "num_tokens hidden"]
    aux_hidden_states: tuple[Float[Tensor, "num_tokens hidden"], ...] = ()


def rope_tables(
    positions: Int[Tensor, " num_tokens"], head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Float[Tensor, "num_tokens 1 head_dim"], Float[Tensor, "num_tokens 1 head_dim"]]:
    """RoPE ``cos`` and a sign-folded ``sin`` (first half negated), to apply with ``rotate``.

    The angles are computed exactly as ``layers.apply_rope`` computes them, and
    once per forward: every layer, queries and keys alike, shares them (the
    per-call version recomputed them 2 x num_layers times a step).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    sin = emb.sin().to(dtype)
    half = head_dim // 2
    return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(
    x: Float[Tensor, "num_tokens heads head_dim"],
    cos: Float[Tensor, "num_tokens 1 head_dim"],
    signed_sin: Float[Tensor, "num_tokens 1 head_dim"],
) -> Float[Tensor, "num_tokens heads head_dim"]:
    """``apply_rope`` with tables from ``rope_tables``, bit for bit.

    ``rotate_half(x) * sin`` equals ``roll(x, d/2) * signed_sin``: the halves
    swap, and the negation moves from ``x`` to ``sin`` (a sign flip is exact),
    in one op instead of four.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(eq=False)
class SharedStep:
    """What every layer of one forward shares: the RoPE tables, the KV write rows and the attention plan.

    ``Transformer.forward`` makes one per call; the first layer fills it and the
    rest reuse it. The plan is built at first use, not up front, so a metadata
    error still surfaces where it did before (after layer 0's KV write and
    sparse indexer, as a kernel launch would meet it).
    """

    rope: tuple[Tensor, Tensor] | None = None
    write_rows: Tensor | None = None
    plan: AttentionPlan | None = None
    per_request: bool = False
    """Attend every request alone (``Transformer.batch_invariant``)."""
    exact_rows: bool = True
    """Each bf16 verify row attends as the decode of its token would (``Transformer.exact_verify``)."""


class Embedding(nn.Module):
    """Token embedding ``[vocab, hidden]``; shared with drafters and, when tied, with the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, init: WeightInit, name: str) -> None:
        super().__init__()
        self.weight = init.parameter(f"{name}.weight", (vocab_size, hidden_size), 1.0)

    def forward(self, input_ids: Int[Tensor, " num_tokens"]) -> Float[Tensor, "num_tokens hidden"]:
        return F.embedding(input_ids, self.weight)


class SelfAttention(nn.Module):
    """Grouped-query attention with RoPE, optionally restricted by a sparse indexer on decode steps."""

    def __init__(self, config: ModelConfig, init: WeightInit, name: str, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        hidden, kv_width = config.hidden_size, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(hidden, config.num_heads * config.head_dim, init, f"{name}.q_proj")
        self.k_proj = Linear(hidden, kv_width, init, f"{name}.k_proj")
        self.v_proj = Linear(hidden, kv_width, init, f"{name}.v_proj")
        self.o_proj = Linear(config.num_heads * config.head_dim, hidden, init, f"{name}.o_proj")
        self.qkv = PackedLinear()
        """``q_proj``, ``k_proj`` and ``v_proj`` packed as one matrix (one matmul on the packed path)."""
        self.kv_packed = PackedLinear()
        """``k_proj`` and ``v_proj`` alone, for ``cache_kv`` (packed on first use or by ``prepare_packed``)."""
        self.q_packed = PackedLinear()
        """``q_proj`` alone, for ``forward_rows``."""
        self.indexer = (
            SparseIndexer(config.indexer, hidden, kv_width, init, f"{name}.indexer")
            if config.indexer is not None
            else None
        )

    def prepare_packed(self, *, rows_path: bool = False) -> None:
        """The matrices a forward multiplies (q, k and v only as their fused copy); with ``rows_path``, also the
        separate K/V and Q copies ``forward_rows`` multiplies."""
        self.qkv.prepare((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        self.o_proj.prepare_packed()
        if rows_path:
            self.kv_packed.prepare((self.k_proj.weight, self.v_proj.weight))
            self.q_packed.prepare((self.q_proj.weight,))

    def project(
        self,
        h: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        shared: SharedStep | None = None,
    ) -> tuple[
        Float[Tensor, "num_tokens heads head_dim"],
        Float[Tensor, "num_tokens kv_heads head_dim"],
        Float[Tensor, "num_tokens kv_heads head_dim"],
    ]:
        """Rotated queries and keys, and values, for every model row (RoPE tables from ``shared`` when filled)."""
        n = h.shape[0]
        # The weights, not the modules: a module call costs ~10 us on a small CPU, 120 per step here.
        q, k, v = self.qkv.run(h, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        rope = shared.rope if shared is not None else None
        if rope is None:
            rope = rope_tables(positions, self.head_dim, self.rope_theta, q.dtype)
            if shared is not None:
                shared.rope = rope
        cos, sin = rope
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(
        self,
        h: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        shared: SharedStep | None = None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        """Write K/V for every model row, then attend with the first ``meta.num_tokens_padded`` rows."""
        q, k, v = self.project(h, positions, shared)
        write_rows = shared.write_rows if shared is not None else None
        if write_rows is None:
            write_rows = kv.write_rows(meta.slot_mapping)
            if shared is not None:
                shared.write_rows = write_rows
        write_kv(kv, self.layer, meta, k, v, buffer_rows=write_rows)
        rows = meta.num_tokens_padded
        sparse_mask = None
        if self.indexer is not None and SparseIndexer.applies_to(meta):
            sparse_mask = self.indexer(h[:rows], meta, kv, self.layer)
        plan = shared.plan if shared is not None else None
        if plan is None:
            plan = AttentionPlan.build(
                meta,
                kv,
                rows,
                per_request=shared is not None and shared.per_request,
                exact_rows=shared is None or shared.exact_rows,
            )
            if shared is not None:
                shared.plan = plan
        attended = paged_attention(q[:rows], meta, kv, self.layer, sparse_mask=sparse_mask, plan=plan)
        if rows < h.shape[0]:  # rows past the attention rows (DP padding) get zeros
            attended = torch.cat([attended, attended.new_zeros((h.shape[0] - rows, *attended.shape[1:]))])
        out = attended.reshape(h.shape[0], self.num_heads * self.head_dim)
        return self.o_proj.packed.run(out, (self.o_proj.weight,))[0]

    def cache_kv(
        self,
        h: Float[Tensor, "rows hidden"],
        positions: Int[Tensor, " rows"],
        slot_mapping: Int[Tensor, " rows"],
        kv: PagedKVStorage,
    ) -> tuple[Float[Tensor, "rows 1 head_dim"], Float[Tensor, "rows 1 head_dim"]]:
        """Write the rows' K/V at ``slot_mapping`` and nothing else; returns the RoPE tables of ``positions``."""
        n = h.shape[0]
        k, v = self.kv_packed.run(h, (self.k_proj.weight, self.v_proj.weight))
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, k.dtype)
        k = rotate(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        kv.write(self.layer, slot_mapping, k, v.view(n, self.num_kv_heads, self.head_dim))
        return cos, sin

    def forward_rows(
        self,
        h: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        rows: Sequence[int],
    ) -> Float[Tensor, "rows hidden"]:
        """Write K/V for every model row, then attend and project out only ``rows`` (in that order).

        For a causal drafter that reads its output at a few rows but must cache
        every row's K/V; ``forward``'s output at those rows, up to summation
        order, padded rows included. Dense attention only (no sparse indexer).
        """
        if self.indexer is not None:
            raise ValueError("forward_rows attends densely; a layer with a sparse indexer runs forward")
        check_slot_mapping(meta, h.shape[0])
        cos, sin = self.cache_kv(h, positions, meta.slot_mapping, kv)
        if not rows:
            return h.new_zeros((0, self.o_proj.weight.shape[0]))
        index = torch.tensor(list(rows), dtype=torch.int64, device=h.device)
        (q,) = self.q_packed.run(h.index_select(0, index), (self.q_proj.weight,))
        q = rotate(q.view(len(rows), self.num_heads, self.head_dim), cos[index], sin[index])
        # Rows past the real requests' queries (graph or DP padding) attend to nothing, as in ``forward``.
        owned = host_query_start_loc(meta)[meta.num_reqs]
        real = [i for i, row in enumerate(rows) if row < owned]
        if len(real) == len(rows):
            attended = paged_attention(q, query_rows_metadata(meta, rows), kv, self.layer)
        else:
            attended = torch.zeros_like(q)
            if real:
                at = torch.tensor(real, dtype=torch.int64, device=h.device)
                sub = query_rows_metadata(meta, [rows[i] for i in real])
                attended.index_copy_(0, at, paged_attention(q.index_select(0, at), sub, kv, self.layer))
        out = attended.reshape(len(rows), self.num_heads * self.head_dim)
        return self.o_proj.packed.run(out, (self.o_proj.weight,))[0]

    def forward_dense(
        self, h: Float[Tensor, "seq_len hidden"], positions: Int[Tensor, " seq_len"], causal: bool
    ) -> Float[Tensor, "seq_len hidden"]:
        """One sequence without any cache, through ``scaled_dot_product_attention``: the test oracle."""
        q, k, v = self.project(h, positions)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(h.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then a SwiGLU MLP or an expert-parallel MoE."""

    def __init__(self, config: ModelConfig, init: WeightInit, layer: int) -> None:
        super().__init__()
        name = f"model.layers.{layer}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, init, f"{name}.input_layernorm")
        self.self_attn = SelfAttention(config, init, f"{name}.self_attn", layer)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, init, f"{name}.post_attention_layernorm"
        )
        self.mlp: SwiGLUMLP | MoEMLP = (
            MoEMLP(config.moe, config.hidden_size, config.expert_intermediate_size, init, f"{name}.mlp", layer)
            if config.moe is not None
            else SwiGLUMLP(config.hidden_size, config.intermediate_size, init, f"{name}.mlp")
        )

    def prepare_packed(self, *, rows_path: bool = False) -> None:
        """Pack this layer's weights for the decode-sized path now (a drafter's ``bind``), not in its first step;
        ``rows_path``: for ``forward_rows`` too."""
        self.self_attn.prepare_packed(rows_path=rows_path)
        if isinstance(self.mlp, SwiGLUMLP):
            self.mlp.prepare_packed()

    def run_mlp(
        self,
        x: Float[Tensor, "num_tokens hidden"],
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoEMLP):
            return x + self.mlp(h, dp_group=dp_group, num_tokens_across_dp=num_tokens_across_dp)
        return x + self.mlp(h)

    def forward(
        self,
        x: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        dp_group: DPGroup | None = None,
        num_tokens_across_dp: Sequence[int] | None = None,
        shared: SharedStep | None = None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv, shared)
        return self.run_mlp(x, dp_group, num_tokens_across_dp)

    def cache_kv(
        self,
        x: Float[Tensor, "rows hidden"],
        positions: Int[Tensor, " rows"],
        slot_mapping: Int[Tensor, " rows"],
        kv: PagedKVStorage,
    ) -> None:
        """Only the rows' K/V, written at ``slot_mapping``: what later queries read of rows nobody samples."""
        self.self_attn.cache_kv(self.input_layernorm(x), positions, slot_mapping, kv)

    def forward_rows(
        self,
        x: Float[Tensor, "num_tokens hidden"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        rows: Sequence[int],
        dp_group: DPGroup | None = None,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> Float[Tensor, "rows hidden"]:
        """The layer's output at ``rows`` only, every row's K/V cached: a last layer whose other rows nobody reads.

        A one-layer EAGLE drafter reads its prefill output at the rows it samples
        (one per drafting request, none on a step where nobody drafts), yet ran
        attention and the MLP over every verify and prompt row. A sparse-indexer
        or MoE layer (its experts' collectives need every rank's rows) runs the
        whole layer and returns the rows.
        """
        if self.self_attn.indexer is not None or isinstance(self.mlp, MoEMLP):
            full = self.forward(x, positions, meta, kv, dp_group, num_tokens_across_dp)
            return full.index_select(0, torch.tensor(list(rows), dtype=torch.int64, device=x.device))
        attended = self.self_attn.forward_rows(self.input_layernorm(x), positions, meta, kv, rows)
        if not rows:
            return attended
        index = torch.tensor(list(rows), dtype=torch.int64, device=x.device)
        return self.run_mlp(x.index_select(0, index) + attended, None, None)

    def forward_dense(
        self, x: Float[Tensor, "seq_len hidden"], positions: Int[Tensor, " seq_len"], causal: bool
    ) -> Float[Tensor, "seq_len hidden"]:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), positions, causal)
        return self.run_mlp(x, None, None)


class DecoderStack(nn.Module):
    """The ``model.*`` part of a Hugging Face Llama: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, init: WeightInit) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, init, "model.embed_tokens")
        self.layers = nn.ModuleList(DecoderLayer(config, init, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, init, "model.norm")

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, typed (``nn.ModuleList`` items are plain ``nn.Module`` to a type checker)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


class Transformer(nn.Module):
    """The reference target (and draft) model; weights drawn deterministically from ``seed``."""

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        draw_weights: bool = True,
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"model dtype must be floating point, got {dtype}")
        self.config = config
        self.seed = seed
        self.dtype = dtype
        init = WeightInit(seed, dtype, device, draw=draw_weights)
        self.model = DecoderStack(config, init)
        self.lm_head: Linear | None = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, init, "lm_head")
        )
        self._lm_head_packed = PackedLinear()
        self._batch_invariant = False
        self.exact_verify = True
        """Whether a bf16 verify row equals the decode step of the same token bit for bit (on by default).

        On, each bf16 verify row attends as a decode step of its token does: one
        query row over its prefix, with the same rounded-up width
        (``attention.EXACT_WIDTH_MULTIPLE``), the request's rows laid along the
        kernel's batch dimension, so speculative greedy output equals plain greedy
        output even at exact logit ties. Off, a request's verify rows attend as
        one masked call of several query rows: with the earlier row-by-row exact
        path, on the benchmark CPU (bf16, AMX), that took batch-1 greedy HumanEval
        from 1.46-1.68x to 1.67-1.87x plain and batch 8 with ``batch_invariant``
        from 1.06-1.12x to 1.22-1.28x, but such a call rounds differently from the
        decode, and greedy output then parts from plain decoding at near ties,
        some beyond what the bench's tie analysis allows (docs/benchmarks.md).
        fp32 always takes the masked call (its linears vary with the row count).
        """

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's logits are independent of the rest of its batch (bf16; off by default).

        On, every request attends as it would alone (bf16 rows as in
        ``exact_verify``; the decode and verify rows of the requests of one query
        length share one call, each over a width that keeps its bits,
        ``AttentionPlan.build``) and every packed linear multiplies at most
        ``ROW_INVARIANT_ROWS`` rows per call, so a bf16 model computes a request in
        a batch bit for bit as it computes it alone, and speculative greedy output in
        a batch equals plain greedy output of the request alone. It costs an
        attention call per query length and per prefilling request, and a weight
        read per 32 rows. fp32's unpacked MKL linears vary with
        the row count, so fp32 is not made batch-invariant.
        """
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        if on and self.dtype == torch.bfloat16 and not mkldnn_bf16_available():
            raise ValueError(
                "batch_invariant needs oneDNN's packed bf16 matmul (a CPU with AVX512-BF16, AVX-NE-CONVERT or "
                "AVX512BW/VL/DQ); this CPU has none, so a bf16 request's bits would still depend on its batch"
            )
        self._batch_invariant = on
        set_row_chunk(self, ROW_INVARIANT_ROWS if on else None)

    # -- shared with drafters ----------------------------------------------------------------------

    def decode_products(self) -> list[tuple[PackedLinear, tuple[Tensor, ...]]]:
        """Every linear product of a decode forward in order, as (packed copy, weights it multiplies): what a
        kernel choice is timed on (``specdec.nn.fp32_kernels``)."""
        products = [product for layer in self.model.decoder_layers() for product in _layer_products(layer)]
        products.append((self._lm_head_packed, (self.lm_head_weight,)))
        return products

    def prefill_products(self) -> list[tuple[PackedLinear, tuple[Tensor, ...]]]:
        """The first decoder layer's linear products: a prefill's kernel is timed on them.

        Every layer has the same shapes, and at a prefill's row count a product is
        bound by arithmetic rather than by streaming its weights from memory, so
        one layer's products repeated time like the whole model's (on SmolLM2 at
        256 rows, one layer 30 times took 0.98-1.02x a pass over all 30). The LM
        head is left out: a prefill scores only its last rows.
        """
        return _layer_products(self.model.decoder_layers()[0])

    @property
    def lm_head_weight(self) -> Float[Tensor, "vocab hidden"]:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: Int[Tensor, " num_tokens"]) -> Float[Tensor, "num_tokens hidden"]:
        """Token embeddings; drafters call this to share the target's table."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: Float[Tensor, "num_rows hidden"]) -> Float[Tensor, "num_rows vocab"]:
        """The LM head (tied to the embeddings or not) on already-normed hidden states, as float32 logits.

        A bf16 model multiplies in bf16 (float32 accumulation, the output rounded
        to bf16, as transformers' bf16 LM head does) and returns the logits cast to
        float32, so sampling and verification never do arithmetic in bf16.
        Differentiable in ``hidden`` (drafters train through the shared head).
        """
        return self._lm_head_packed.run(hidden, (self.lm_head_weight,))[0].float()

    def make_kv_storage(self, num_blocks: int, block_size: int) -> PagedKVStorage:
        """A paged cache with this model's layer count, KV heads, head size, dtype and device."""
        c = self.config
        return PagedKVStorage(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device
        )

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # -- forwards ----------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Int[Tensor, " num_tokens"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        *,
        aux_layers: Sequence[int] = (),
        inputs_embeds: Float[Tensor, "num_tokens hidden"] | None = None,
        dp_group: DPGroup | None = None,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> ModelOutput:
        """One step over the paged cache: prefill, decode, verify, block-draft or a mix, padded or not.

        ``inputs_embeds`` replaces the embedding lookup (drafters that fuse
        target hidden states); ``aux_layers`` selects decoder layers whose
        outputs are returned (EAGLE-3, DFlash read them). ``dp_group`` and
        ``num_tokens_across_dp`` are used by the MoE's expert-parallel dispatch.
        """
        rows = input_ids.shape[0]
        self._validate_step(rows, positions, meta, kv, inputs_embeds)
        wanted = self._aux_indices(aux_layers)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        captured: dict[int, Tensor] = {}
        shared = SharedStep(per_request=self.batch_invariant, exact_rows=self.exact_verify)
        for i, layer in enumerate(self.model.decoder_layers()):
            x = layer(x, positions, meta, kv, dp_group, num_tokens_across_dp, shared)
            if i in wanted:
                captured[i] = x
        return ModelOutput(self.model.norm(x), tuple(captured[i] for i in aux_layers))

    def forward_dense(
        self,
        input_ids: Int[Tensor, " seq_len"],
        *,
        aux_layers: Sequence[int] = (),
        causal: bool = True,
    ) -> ModelOutput:
        """One whole sequence at positions ``0..seq_len-1`` with no cache: the oracle the paged path must match.

        Dense attention throughout (no sparse indexer) and all MoE experts local.
        """
        wanted = self._aux_indices(aux_layers)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        x = self.embed(input_ids)
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.decoder_layers()):
            x = layer.forward_dense(x, positions, causal)
            if i in wanted:
                captured[i] = x
        return ModelOutput(self.model.norm(x), tuple(captured[i] for i in aux_layers))

    # -- weights -----------------------------------------------------------------------------------

    def named_weights(self) -> dict[str, Tensor]:
        """Every weight by its Hugging Face name (no ``lm_head.weight`` when tied)."""
        return dict(self.state_dict())

    @classmethod
    def from_hf_state_dict(
        cls,
        config: ModelConfig,
        state: Mapping[str, Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> Transformer:
        """A model holding a checkpoint's weights, built without drawing (and then discarding) seeded ones.

        The modules are built on the meta device and the checkpoint tensors are
        assigned, so a checkpoint already in ``dtype`` on ``device`` is used
        without a copy. Every weight must be present (``lm_head.weight`` only
        when untied). ``seed`` is recorded for drafters that seed themselves
        from the target; it does not affect the weights.
        """
        model = cls(config, seed=seed, dtype=dtype, device="meta", draw_weights=False)
        model._load_hf(state, torch.device(device), strict=True, assign=True)
        return model

    def load_hf_state_dict(self, state: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Fill the weights from a Hugging Face Llama state dict, casting to this model's dtype.

        A tied model ignores ``lm_head.weight`` if the checkpoint carries one;
        rotary ``inv_freq`` buffers of older checkpoints are ignored too.
        """
        self._load_hf(state, self.device, strict=strict, assign=False)

    def _load_hf(self, state: Mapping[str, Tensor], device: torch.device, *, strict: bool, assign: bool) -> None:
        ignored = ("rotary_emb.inv_freq",)
        own = self.named_weights()
        usable = {k: v for k, v in state.items() if not k.endswith(ignored)}
        if self.lm_head is None:
            usable.pop("lm_head.weight", None)
        wrong = [
            (k, tuple(v.shape), tuple(own[k].shape)) for k, v in usable.items() if k in own and v.shape != own[k].shape
        ]
        if wrong:
            raise ValueError(f"checkpoint shapes differ from the config (name, checkpoint, model): {wrong}")
        if strict:
            missing = sorted(own.keys() - usable.keys())
            unexpected = sorted(usable.keys() - own.keys())
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint does not match the model: missing {missing[:8]} ({len(missing)} in all), "
                    f"unexpected {unexpected[:8]} ({len(unexpected)} in all)"
                )
        converted = {k: v.to(dtype=self.dtype, device=device) for k, v in usable.items()}
        self.load_state_dict(converted, strict=strict, assign=assign)

    # -- validation --------------------------------------------------------------------------------

    def _aux_indices(self, aux_layers: Iterable[int]) -> set[int]:
        wanted = set(aux_layers)
        bad = sorted(i for i in wanted if not 0 <= i < self.config.num_layers)
        if bad:
            raise ValueError(f"aux_layers {bad} are outside [0, num_layers={self.config.num_layers})")
        return wanted

    def _validate_step(
        self,
        rows: int,
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        inputs_embeds: Float[Tensor, "num_tokens hidden"] | None,
    ) -> None:
        """Shape-only checks (no device reads): the row counts a fused model runner would assume."""
        if positions.shape != (rows,):
            raise ValueError(f"positions has shape {tuple(positions.shape)}; one position per model row ({rows})")
        if inputs_embeds is not None and tuple(inputs_embeds.shape) != (rows, self.config.hidden_size):
            raise ValueError(
                f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; [{rows}, {self.config.hidden_size}] expected"
            )
        if meta.slot_mapping.shape[0] != rows:
            raise ValueError(
                f"meta.slot_mapping has {meta.slot_mapping.shape[0]} entries but the model runs {rows} rows "
                "(input_ids.shape[0] == desc.num_tokens); every model row writes K/V, padded rows to PAD_SLOT_ID"
            )
        if meta.num_tokens_padded > rows:
            raise ValueError(
                f"meta.num_tokens_padded ({meta.num_tokens_padded}) exceeds the model rows ({rows}); "
                "attention runs on a prefix of the model rows"
            )
        c = self.config
        if kv.num_layers < c.num_layers or (kv.num_kv_heads, kv.head_dim) != (c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"KV storage ({kv.num_layers} layers, {kv.num_kv_heads} KV heads of {kv.head_dim}) does not fit "
                f"the model ({c.num_layers} layers, {c.num_kv_heads} KV heads of {c.head_dim})"
            )
        if kv.dtype != self.dtype:
            raise ValueError(f"KV storage dtype {kv.dtype} differs from the model dtype {self.dtype}")


def _layer_products(layer: DecoderLayer) -> list[tuple[PackedLinear, tuple[Tensor, ...]]]:
    """One decoder layer's linear products in forward order (an MoE layer's experts are not packed)."""
    attn = layer.self_attn
    products: list[tuple[PackedLinear, tuple[Tensor, ...]]] = [
        (attn.qkv, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
        (attn.o_proj.packed, (attn.o_proj.weight,)),
    ]
    if isinstance(layer.mlp, SwiGLUMLP):
        mlp = layer.mlp
        products.append((mlp.gate_up, (mlp.gate_proj.weight, mlp.up_proj.weight)))
        products.append((mlp.down_proj.packed, (mlp.down_proj.weight,)))
    return products
