"""The two draft networks of the autoregressive backend.

``EagleHead``: one decoder layer over the token embedding fused with target
hidden states (EAGLE-3: several target layers fused by a linear layer), sharing
the target's embedding and LM head. ``ModelDrafter``: any reference-transformer
config with the target's vocabulary, run as an independent small model.
Both are called through ``DraftContext.forward`` (the checked boundary).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from backends.draft_vocab import DraftVocab, head_logits
from contracts import AttentionMetadata
from specdec.dp_group import DPGroup
from specdec.kv_storage import PagedKVStorage
from specdec.nn.config import ModelConfig
from specdec.nn.layers import Linear, RMSNorm, WeightInit
from specdec.nn.packed_linear import DRAFTER_ROW_CHUNK, set_row_chunk
from specdec.nn.transformer import DecoderLayer, Transformer
from specdec.speculator import DraftOutput, rows_to_score


class EagleHead(nn.Module):
    """EAGLE-style head: ``layer(proj([embed(x_{t+1}); f_t]))`` with the target's embedding and LM head.

    ``f_t`` is the fusion of the target's auxiliary hidden states at the draft
    prefill, and the head's own previous pre-norm hidden state at later steps,
    which is why both have the target's hidden width.
    """

    def __init__(
        self, target: Transformer, *, num_aux: int, seed: int, layer_config: ModelConfig | None = None
    ) -> None:
        super().__init__()
        hidden = target.config.hidden_size
        config = layer_config or target.config.model_copy(update={"num_layers": 1})
        if config.hidden_size != hidden or config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"an EAGLE head shares the target's width and vocabulary: got hidden {config.hidden_size} "
                f"(target {hidden}), vocab {config.vocab_size} (target {target.config.vocab_size})"
            )
        init = WeightInit(seed, target.dtype, target.device)
        self.config = config
        self.num_aux = num_aux
        self.fuse = Linear(num_aux * hidden, hidden, init, "fc")
        self.input_proj = Linear(2 * hidden, hidden, init, "input_proj")
        self.layer = DecoderLayer(config, init, 0)
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
        """Pack the head's weights and cut its draft vocabulary's sub-head once, when it is bound to an engine."""
        self.fuse.prepare_packed()
        self.input_proj.prepare_packed()
        self.layer.prepare_packed(rows_path=True)
        if self.draft_vocab is not None:
            self.draft_vocab.prepare(self.target)
        set_row_chunk(self, DRAFTER_ROW_CHUNK)

    def fuse_aux(self, aux: Sequence[Float[Tensor, "*rows hidden"]]) -> Float[Tensor, "*rows hidden"]:
        if len(aux) != self.num_aux:
            raise ValueError(f"EAGLE head fuses {self.num_aux} target layers, got {len(aux)}")
        result: Tensor = self.fuse(torch.cat(list(aux), dim=-1))
        return result

    def forward(
        self,
        input_ids: Int[Tensor, " num_tokens"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        *,
        features: Float[Tensor, "num_tokens hidden"] | None,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
        scored_rows: Sequence[int] | None = None,
    ) -> DraftOutput:
        if features is None:
            raise ValueError("an EAGLE head needs per-row features (fused target hidden states or its own)")
        x = self.input_proj(torch.cat([self.target.embed(input_ids), features], dim=-1))
        if scored_rows is None:
            h = self.layer(x, positions, meta, kv, dp_group, num_tokens_across_dp)
        else:  # one layer: nothing reads its output at rows it does not score, only their K/V (later queries do)
            h = self.layer.forward_rows(x, positions, meta, kv, scored_rows, dp_group, num_tokens_across_dp)
        return DraftOutput(h, self.head_logits(self.norm(h)))

    def write_context(
        self,
        input_ids: Int[Tensor, " rows"],
        positions: Int[Tensor, " rows"],
        aux: Sequence[Float[Tensor, "rows hidden"]],
        slot_mapping: Int[Tensor, " rows"],
        kv: PagedKVStorage,
    ) -> None:
        """The layer's K/V of committed rows nobody samples (held from idle steps); no query, attention or MLP."""
        x = self.input_proj(torch.cat([self.target.embed(input_ids), self.fuse_aux(aux)], dim=-1))
        self.layer.cache_kv(x, positions, slot_mapping, kv)

    def make_kv_storage(self, num_blocks: int, block_size: int) -> PagedKVStorage:
        c = self.config
        return PagedKVStorage(
            1, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=self.target.dtype, device=self.target.device
        )


class ModelDrafter(nn.Module):
    """A separate small draft model (or the target itself, for tests that need full acceptance)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Int[Tensor, " num_tokens"],
        positions: Int[Tensor, " num_tokens"],
        meta: AttentionMetadata,
        kv: PagedKVStorage,
        *,
        features: Float[Tensor, "num_tokens hidden"] | None,
        dp_group: DPGroup | None,
        num_tokens_across_dp: Sequence[int] | None,
        scored_rows: Sequence[int] | None = None,
    ) -> DraftOutput:
        del features  # a standalone model sees tokens only
        out = self.model(input_ids, positions, meta, kv, dp_group=dp_group, num_tokens_across_dp=num_tokens_across_dp)
        h = rows_to_score(out.hidden_states, scored_rows)
        return DraftOutput(h, self.model.compute_logits(h))

    def make_kv_storage(self, num_blocks: int, block_size: int) -> PagedKVStorage:
        return self.model.make_kv_storage(num_blocks, block_size)
