"""The reference transformer: a Llama-style model over the paged KV cache, with optional MoE and sparse indexer."""

from specdec.model.attention import paged_attention, validate_attention_inputs, write_kv
from specdec.model.config import IndexerConfig, ModelConfig, MoEConfig
from specdec.model.indexer import SparseIndexer
from specdec.model.moe import MoEMLP
from specdec.model.transformer import ModelOutput, Transformer

__all__ = [
    "IndexerConfig",
    "MoEConfig",
    "MoEMLP",
    "ModelConfig",
    "ModelOutput",
    "SparseIndexer",
    "Transformer",
    "paged_attention",
    "validate_attention_inputs",
    "write_kv",
]
