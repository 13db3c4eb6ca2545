"""Shape of the reference transformer: a frozen, validated configuration.

Validation happens once, here, so that the layers can trust their dimensions
and a bad configuration fails with a message naming the fields instead of a
shape error deep inside a forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class MoEConfig(BaseModel):
    """Mixture-of-experts MLP: ``num_experts`` SwiGLU experts, ``top_k`` routed per token."""

    model_config = ConfigDict(frozen=True)

    num_experts: int
    top_k: int
    intermediate_size: int | None = None
    """Width of one expert; ``None`` uses the model's ``intermediate_size``."""

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"moe.intermediate_size must be >= 1, got {self.intermediate_size}")
        return self


class IndexerConfig(BaseModel):
    """DeepSeek-V3.2-style sparse indexer: ``num_heads`` index heads of ``head_dim``, ``topk`` kept positions.

    The defaults are DeepSeek-V3.2's head shape (64 x 128), the shape of the
    motivating failure; tests with tiny models keep it, since the indexer's
    projections are only ``hidden x 8192``.
    """

    model_config = ConfigDict(frozen=True)

    num_heads: int = 64
    head_dim: int = 128
    topk: int = 2048

    @model_validator(mode="after")
    def _check(self) -> IndexerConfig:
        for name in ("num_heads", "head_dim", "topk"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"indexer.{name} must be >= 1, got {value}")
        return self


class ModelConfig(BaseModel):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU (or MoE) MLP, grouped-query attention."""

    model_config = ConfigDict(frozen=True)

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_model_len: int = 2048
    moe: MoEConfig | None = None
    indexer: IndexerConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_model_len",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        return self

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one MoE expert (the dense MLP width unless the MoE config overrides it)."""
        if self.moe is None or self.moe.intermediate_size is None:
            return self.intermediate_size
        return self.moe.intermediate_size

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """The config of a Hugging Face Llama ``config.json``; refuses features this model does not implement.

        A checkpoint that needs rope scaling, biases or another activation would
        load without error and produce wrong logits, so those fail here instead.
        """
        model_type = hf.get("model_type")
        if model_type != "llama":
            raise ValueError(f"config.json has model_type {model_type!r}; only 'llama' checkpoints are supported")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in hf:
                raise ValueError(f"config.json lacks {key!r}, which a Llama config must state")
        unsupported = [
            f"{key}={hf[key]!r}"
            for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"))
            if key in hf and hf[key] != ok
        ]
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling")
        if scaling:
            rope = {**dict(scaling), **rope}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            unsupported.append(f"rope_type={rope_type!r}")
        if unsupported:
            raise ValueError(
                f"config.json asks for {', '.join(unsupported)}; the reference Llama implements none of it"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_model_len=int(hf.get("max_position_embeddings", 2048)),
        )

    @classmethod
    def tiny(
        cls,
        *,
        vocab_size: int = 96,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        intermediate_size: int = 64,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        max_model_len: int = 256,
        moe: MoEConfig | None = None,
        indexer: IndexerConfig | None = None,
    ) -> ModelConfig:
        """A model small enough that a whole Hypothesis run of forwards takes seconds on a CPU."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            rope_theta=rope_theta,
            rms_norm_eps=rms_norm_eps,
            tie_word_embeddings=tie_word_embeddings,
            max_model_len=max_model_len,
            moe=moe,
            indexer=indexer,
        )
