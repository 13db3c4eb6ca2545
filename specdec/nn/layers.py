"""Building blocks of the reference transformer: seeded weights, linear, RMSNorm, RoPE, SwiGLU.

Every weight is drawn from its own ``torch.Generator`` seeded by (model seed,
Hugging Face parameter name). A weight therefore depends only on the seed, its
name and its shape: the same seed gives the same weights on any run and any
device, and turning an optional component on (MoE, indexer) does not change the
weights the components share.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from specdec.nn.packed_linear import PackedLinear


@dataclass(frozen=True)
class WeightInit:
    """Where weights come from: a seed, and the dtype and device they are materialised in."""

    seed: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    draw: bool = True
    """``False`` leaves weights uninitialised (``torch.empty``) for a checkpoint loader to fill: drawing 135M
    seeded normals only to overwrite them costs seconds."""

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> Float[Tensor, "*shape"]:
        """``N(mean, std^2)`` drawn on the CPU in float32 from the stream of ``name``, then cast and moved."""
        if not self.draw:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(device="cpu").manual_seed(stream_seed(self.seed, name))
        values = torch.randn(shape, generator=generator, dtype=torch.float32) * std + mean
        return values.to(dtype=self.dtype, device=self.device)

    def parameter(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> nn.Parameter:
        """An inference parameter (no gradient: the cache writes would otherwise build a graph across steps)."""
        return nn.Parameter(self.normal(name, shape, std, mean), requires_grad=False)


def stream_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one named weight; stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Linear(nn.Module):
    """A bias-free linear layer (Llama has no biases); weight ``[out, in]`` as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, init: WeightInit, name: str) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # std 1/sqrt(fan_in) keeps activations O(1) so that tiny test models produce non-trivial logits.
        self.weight = init.parameter(f"{name}.weight", (out_features, in_features), 1.0 / math.sqrt(in_features))
        self.packed = PackedLinear()

    def forward(self, x: Float[Tensor, "*batch in_features"]) -> Float[Tensor, "*batch out_features"]:
        return self.packed.run(x, (self.weight,))[0]

    def prepare_packed(self) -> None:
        self.packed.prepare((self.weight,))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back as Hugging Face Llama does."""

    def __init__(self, dim: int, eps: float, init: WeightInit, name: str) -> None:
        super().__init__()
        self.eps = eps
        # Not all ones: a test that loads or permutes norm weights must see a difference.
        self.weight = init.parameter(f"{name}.weight", (dim,), 0.1, mean=1.0)

    def forward(self, x: Float[Tensor, "*batch dim"]) -> Float[Tensor, "*batch dim"]:
        # F.rms_norm runs the chain in one call, bit for bit. With the weight inside it multiplies before rounding
        # to bf16, which Hugging Face does after, so only float32 passes the weight in.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x: Float[Tensor, "*batch head_dim"]) -> Float[Tensor, "*batch head_dim"]:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    x: Float[Tensor, "num_tokens heads head_dim"],
    positions: Int[Tensor, " num_tokens"],
    theta: float,
) -> Float[Tensor, "num_tokens heads head_dim"]:
    """Rotary embedding in the Hugging Face (half-split) layout; angles computed in float32."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the Llama MLP, and the shape of one MoE expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, init: WeightInit, name: str) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, init, f"{name}.gate_proj")
        self.up_proj = Linear(hidden_size, intermediate_size, init, f"{name}.up_proj")
        self.down_proj = Linear(intermediate_size, hidden_size, init, f"{name}.down_proj")
        self.gate_up = PackedLinear()
        """``gate_proj`` and ``up_proj`` packed as one matrix (one matmul on the packed path)."""

    def forward(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        gate, up = self.gate_up.run(x, (self.gate_proj.weight, self.up_proj.weight))
        return self.down_proj(F.silu(gate) * up)

    def prepare_packed(self) -> None:
        """The matrices ``forward`` multiplies (gate and up only as their fused copy)."""
        self.gate_up.prepare((self.gate_proj.weight, self.up_proj.weight))
        self.down_proj.prepare_packed()
