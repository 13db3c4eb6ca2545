"""The reference transformer: a Llama-style model over the paged KV cache, with optional MoE and sparse indexer."""

from specdec.nn.attention import paged_attention, validate_attention_inputs, write_kv
from specdec.nn.config import IndexerConfig, ModelConfig, MoEConfig
from specdec.nn.indexer import SparseIndexer
from specdec.nn.moe import MoEMLP
from specdec.nn.transformer import ModelOutput, Transformer

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
