"""A tiny llama GGUF written with ``gguf.GGUFWriter``: store and loader tests without the 93 MB download.

The weights are drawn in Hugging Face layout first; the file then gets them the
way llama.cpp's converter writes them (q/k rows permuted per head, dimensions
reversed, one tensor Q8_0-quantized), so a loader that undoes all of it must
give back exactly the drawn weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from specdec.hub import FileSource, ModelSpec

SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
QUANTIZED = "blk.1.ffn_up.weight"
"""The one Q8_0 tensor: the loader's dequantization path is exercised, within Q8_0's error."""

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 2, 4, 2, 8, 64


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order (an independent copy of the standard construction)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokens() -> list[str]:
    return [*SPECIALS, *byte_alphabet(), *(m.replace(" ", "") for m in MERGES)]


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rows ``[first half, second half]`` interleaved pairwise."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokens())

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.2

    state = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        state |= {
            f"{p}.input_layernorm.weight": 1 + rand(HIDDEN),
            f"{p}.post_attention_layernorm.weight": 1 + rand(HIDDEN),
            f"{p}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": rand(FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": rand(FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
    return state


@dataclass(frozen=True)
class FakeModel:
    path: Path
    sha256: str
    weights: dict[str, torch.Tensor]

    def spec(self, name: str = "tiny-llama", sha256: str | None = None) -> ModelSpec:
        return ModelSpec(name, FileSource(self.path), sha256 or self.sha256, "a tiny test llama", "Apache-2.0")


def write_fake_gguf(path: Path, *, seed: int = 0, rope_scaling: str | None = None, stated_ffn: int = FFN) -> FakeModel:
    weights = hf_weights(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(stated_ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens()))
    if rope_scaling is not None:
        writer.add_string("llama.rope.scaling.type", rope_scaling)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens())
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens()) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(SMOLLM_TEMPLATE)

    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(LAYERS):
        for hf, gg in layer.items():
            gguf_names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    expected = {}
    for hf_name, weight in weights.items():
        name = gguf_names[hf_name]
        stored = weight
        if name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(weight, HEADS)
        elif name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(weight, KV_HEADS)
        array = stored.numpy().astype(np.float32)
        if name == QUANTIZED:
            writer.add_tensor(name, quantize(array, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
        expected[hf_name] = weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return FakeModel(path, hashlib.sha256(path.read_bytes()).hexdigest(), expected)
