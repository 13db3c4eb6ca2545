"""A llama-architecture GGUF as a Hugging Face Llama: ``config.json`` values and fp32 weights with HF names.

Two layout facts matter. GGUF stores a weight with its dimensions reversed
(``ne0`` is the input width), which read row-major is exactly HF's
``[out, in]``. And llama.cpp's converter permutes the rows of ``attn_q`` and
``attn_k`` within each head: llama.cpp rotates adjacent pairs ``(x0, x1),
(x2, x3)`` while HF rotates halves ``(x_i, x_{i + d/2})``, so the converter
interleaves each head's two halves. ``unpermute_rope_rows`` undoes that, per
query head for ``attn_q`` and per KV head for ``attn_k`` (grouped-query
attention). Without it the model still runs but attends wrongly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from jaxtyping import Float
from torch import Tensor

from specdec.hub.errors import UnsupportedModelError

_MISSING = object()

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped reader; parsing the metadata of a 49k-token vocabulary takes a few seconds."""
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from exc


def field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value (arrays as lists); without a default a missing key is an error naming it."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is _MISSING:
            raise UnsupportedModelError(f"the GGUF lacks the metadata key {key!r}")
        return default
    return entry.contents()


def float32_value(value: float) -> float:
    """The shortest decimal that is the same float32: GGUF's 9.9999997e-06 is the checkpoint's 1e-05."""
    return float(str(np.float32(value)))


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a llama GGUF; features the reference model lacks are refused here."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture is {arch!r}; only 'llama' is supported")
    names = {t.name for t in reader.tensors}
    hidden = int(field(reader, "llama.embedding_length"))
    heads = int(field(reader, "llama.attention.head_count"))
    kv_heads = int(field(reader, "llama.attention.head_count_kv", heads))
    head_dim = int(field(reader, "llama.attention.key_length", hidden // heads))
    rope_dims = int(field(reader, "llama.rope.dimension_count", head_dim))
    scaling = field(reader, "llama.rope.scaling.type", "none")
    problems = []
    if rope_dims != head_dim:
        problems.append(f"partial rotary embedding ({rope_dims} of {head_dim} dims)")
    if scaling not in ("none", ""):
        problems.append(f"rope scaling {scaling!r}")
    if "rope_freqs.weight" in names:
        problems.append("per-dimension rope frequencies (rope_freqs.weight)")
    if head_dim != field(reader, "llama.attention.value_length", head_dim):
        problems.append("value heads of another size than key heads")
    if field(reader, "llama.expert_count", 0):
        problems.append("mixture-of-experts layers")
    if problems:
        raise UnsupportedModelError(f"the GGUF needs {', '.join(problems)}; the reference Llama implements none")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(field(reader, "llama.vocab_size", len(tokens.data) if tokens is not None else 0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": float32_value(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float32_value(field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        value = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if value is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(value)
    return config


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in a Hugging Face Llama")


def unpermute_rope_rows(weight: Float[Tensor, "rows cols"], num_heads: int) -> Float[Tensor, "rows cols"]:
    """Undo llama.cpp's per-head interleave of ``attn_q``/``attn_k`` rows (see the module docstring).

    llama.cpp wrote, per head, HF row ``j`` (``j < d/2``) to ``2j`` and row ``d/2 + j`` to ``2j + 1``;
    viewing each head as ``[d/2, 2]`` and transposing to ``[2, d/2]`` puts them back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def dequantized(tensor: Any) -> Float[Tensor, "*dims"]:
    """One GGUF tensor as fp32 in Hugging Face shape (GGUF's dimension order reversed)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise UnsupportedModelError(f"gguf cannot dequantize {tensor.name} ({qtype.name}): {exc}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # A copy: F32 tensors come back as read-only views of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face Llama weight the config implies, with its shape."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{suffix}": shape for suffix, shape in layer.items()}
    return shapes


def hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, Float[Tensor, "*dims"]]]:
    """Every weight as ``(HF name, fp32 tensor)``, q/k rows un-permuted; checks shapes, nothing missing or extra."""
    expected = expected_shapes(config)
    seen = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name not in expected:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name} ({name}) is not part of the config's model")
        weight = dequantized(tensor)
        if tuple(weight.shape) != expected[name]:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name} has shape {tuple(weight.shape)}; the config implies {expected[name]}"
            )
        if tensor.name.endswith(".attn_q.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif tensor.name.endswith(".attn_k.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        seen.add(name)
        yield name, weight
    missing = sorted(expected.keys() - seen)
    if missing:
        raise UnsupportedModelError(f"the GGUF lacks {len(missing)} weights, e.g. {missing[:4]}")


def string_array(reader: GGUFReader, key: str) -> list[str]:
    """A string-array field, checked to be one (tokens, merges)."""
    entry = reader.fields.get(key)
    if entry is None:
        raise UnsupportedModelError(f"the GGUF lacks the metadata key {key!r}")
    if entry.types[:1] != [GGUFValueType.ARRAY] or entry.types[-1] != GGUFValueType.STRING:
        raise UnsupportedModelError(f"GGUF metadata {key!r} is {entry.types}, a string array expected")
    return list(entry.contents())
