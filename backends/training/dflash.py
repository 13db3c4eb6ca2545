"""DFlash training: random anchors, dense block attention over injected context, position-decayed cross-entropy.

Each anchor ``a`` of a sequence becomes a block ``[t_a, MASK x (q-1)]`` at
positions ``a .. a+q-1`` that sees the injected target context of positions
``< a`` plus its own block, bidirectionally, which is exactly what the paged
inference path (``block_attention`` over committed context) computes. The
dense version reuses the network's own submodules, so nothing is trained that
inference does not use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from backends.dflash.network import MASK_TOKEN_ID, DFlashNetwork, context_kv
from backends.registry import spread_layers
from backends.training.checkpoint import TrainCheckpoint
from backends.training.data import TargetFeatures, TrainSchedule, as_features, run_adamw
from backends.training.vocab import HeadRows, head_sampler
from specdec.nn.transformer import Transformer

Labels = Literal["greedy", "data"]


def decay_weights(num: int, gamma: float, device: torch.device) -> Float[Tensor, " num"]:
    """``exp(-(k-1)/gamma)`` for k = 1..num: early block positions matter most, since a miss ends acceptance."""
    k = torch.arange(num, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma)


def sample_anchors(
    batch: int, num_anchors: int, low: int, high: int, g: torch.Generator, device: torch.device
) -> Int[Tensor, "batch num_anchors"]:
    """Distinct random anchors per sequence in ``[low, high]`` (sorted), so blocks cover varied context lengths."""
    span = high - low + 1
    if span < 1:
        raise ValueError(f"sequences too short for the block: anchor range [{low}, {high}] is empty")
    n = min(num_anchors, span)
    picks = torch.stack([torch.randperm(span, generator=g)[:n] for _ in range(batch)])
    return (picks.sort(dim=1).values + low).to(device)


def block_hidden(
    network: DFlashNetwork,
    aux: Sequence[Float[Tensor, "batch seq_len hidden"]],
    block_ids: Int[Tensor, "batch rows"],
    anchors: Int[Tensor, "batch num_anchors"],
    q: int,
) -> Float[Tensor, "batch rows hidden"]:
    """Differentiable block forward of every anchor's block (``rows = num_anchors * q``), pre-final-norm.

    Keys are ``[injected context K/V of all positions; block K/V]``; a boolean
    mask lets a block row see context positions ``< anchor`` and its own block.
    """
    if network.echo:
        raise ValueError("an echo DFlash network is a test stand-in and cannot be trained")
    batch, seq_len, hidden = aux[0].shape
    rows = block_ids.shape[1]
    device = block_ids.device
    offsets = torch.arange(q, device=device)
    block_pos = (anchors[:, :, None] + offsets).reshape(batch, rows)
    row_anchor = anchors.repeat_interleave(q, dim=1)  # [batch, rows]
    ctx_pos = torch.arange(seq_len, device=device)
    ctx_allowed = ctx_pos[None, None, :] < row_anchor[:, :, None]
    block_of = torch.arange(rows, device=device) // q
    own_block = (block_of[:, None] == block_of[None, :]).expand(batch, rows, rows)
    allowed = torch.cat([ctx_allowed, own_block], dim=2)[:, None]  # [batch, 1, rows, seq_len + rows]

    feature = network.fuse([a.reshape(batch * seq_len, hidden) for a in aux])
    x = network.embed_block(block_ids.reshape(-1))
    flat_ctx_pos = ctx_pos.repeat(batch)
    for layer in network.decoder_layers():
        attn = layer.self_attn
        q_, k_, v_ = attn.project(layer.input_layernorm(x), block_pos.reshape(-1))
        ck, cv = context_kv(attn, feature, flat_ctx_pos)
        keys = torch.cat([ck.view(batch, seq_len, *ck.shape[1:]), k_.view(batch, rows, *k_.shape[1:])], dim=1)
        values = torch.cat([cv.view(batch, seq_len, *cv.shape[1:]), v_.view(batch, rows, *v_.shape[1:])], dim=1)
        out = F.scaled_dot_product_attention(
            q_.view(batch, rows, *q_.shape[1:]).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=allowed,
            enable_gqa=True,
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch * rows, attn.num_heads * attn.head_dim))
        x = layer.run_mlp(x, None, None)
    return x.view(batch, rows, hidden)


@contextmanager
def trainable(*modules: nn.Module) -> Iterator[list[nn.Parameter]]:
    """Enable gradients on the drafter's own parameters only, restoring the frozen inference state afterwards.

    Inference writes caches from these weights; leaving ``requires_grad`` on
    would chain graphs across engine steps.
    """
    params = [p for m in modules for p in m.parameters()]
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        yield params
    finally:
        for p, flag in zip(params, before, strict=True):
            p.requires_grad_(flag)


def default_aux_layers(network: DFlashNetwork, target: Transformer) -> tuple[int, ...]:
    """The layers the registry's DFlash/DSpark factories inject (``spread_layers``) for this network's width."""
    aux = spread_layers(target.config.num_layers, count=network.num_aux)
    if len(aux) != network.num_aux:
        raise ValueError(f"cannot pick {network.num_aux} aux layers from {target.config.num_layers}; pass aux_layers")
    return aux


def dflash_loss(
    network: DFlashNetwork,
    feats: TargetFeatures,
    index: Int[Tensor, " batch"],
    anchors: Int[Tensor, "batch num_anchors"],
    q: int,
    gamma: float,
    labels: Labels,
    head_rows: HeadRows | None = None,
) -> Tensor:
    """Decay-weighted cross-entropy of mask positions 1..q-1 against the label at their own position.

    ``head_rows`` scores against those LM-head rows only (default: the whole vocabulary).
    """
    tokens = feats.tokens[index]
    batch, num_anchors = anchors.shape
    pos = anchors[:, :, None] + torch.arange(q, device=tokens.device)  # [batch, A, q]
    block_ids = torch.full_like(pos, MASK_TOKEN_ID)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    aux = [a[index].to(network.fc.weight.dtype) for a in feats.aux]  # features may be stored as bf16
    hidden = block_hidden(network, aux, block_ids.view(batch, -1), anchors, q)
    flat = hidden.view(batch, num_anchors, q, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])
    normed = network.norm(flat)
    logits = network.target.compute_logits(normed) if head_rows is None else head_rows.logits(normed)
    mask_pos = pos[:, :, 1:].reshape(batch, -1)
    if labels == "greedy":  # the target's argmax for position p is read at position p - 1
        want = feats.greedy_next[index].gather(1, mask_pos - 1)
    else:
        want = tokens.gather(1, mask_pos)
    if head_rows is not None:
        want = head_rows.index(want)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), want.reshape(-1), reduction="none")
    w = decay_weights(q - 1, gamma, tokens.device).repeat(batch * num_anchors)
    return (ce * w).sum() / w.sum()


def train_dflash(
    network: DFlashNetwork,
    target: Transformer,
    sequences: Int[Tensor, "num seq_len"] | TargetFeatures,
    schedule: TrainSchedule,
    *,
    block_size: int = 4,
    anchors_per_seq: int = 8,
    gamma: float | None = None,
    labels: Labels = "greedy",
    aux_layers: Sequence[int] | None = None,
    min_anchor: int = 1,
    on_step: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
) -> list[float]:
    """AdamW on the drafter's own weights (target embedding and LM head frozen); returns the loss per step.

    ``schedule`` is the optimisation (steps, learning rate, seed, vocabulary subset...);
    ``block_size`` is the query width q = K + 1 (bonus first). Runs on the
    target's device; nothing here is CPU- or GPU-specific.
    """
    q = block_size
    if q < 2:
        raise ValueError(f"a DFlash block needs at least one mask position: block_size={q}")
    gamma = gamma if gamma is not None else max(1.0, (q - 1) / 2)
    device = target.device
    aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(network, target)
    feats = as_features(target, sequences, aux_layers)
    num, seq_len = feats.tokens.shape

    sampler = head_sampler(
        target, feats, keep_top=schedule.keep_top, negatives=schedule.negatives, dtype=schedule.autocast
    )

    def batch_loss(index: Tensor, g: torch.Generator) -> Tensor:
        anchors = sample_anchors(len(index), anchors_per_seq, min_anchor, seq_len - q, g, device)
        head_rows = None if sampler.full else sampler.rows(g)
        return dflash_loss(network, feats, index, anchors, q, gamma, labels, head_rows)

    with trainable(network) as params:
        return run_adamw(
            params,
            schedule,
            num_sequences=num,
            batch_loss=batch_loss,
            name="DFlash",
            on_step=on_step,
            checkpoint=checkpoint,
        )
