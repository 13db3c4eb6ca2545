"""EAGLE-head training: the draft prefill and the unrolled draft decode steps, trained as inference runs them.

At inference the head's draft prefill sees row ``t`` as ``[embed(x_{t+1}); fuse(aux_t)]``
at position ``t`` (causal over its own cache), and decode step ``j`` feeds the
previous step's pre-norm hidden state back as the feature, at position
``t + j - 1``, attending to the prefill K/V of positions ``<= t`` and to its own
earlier decode K/V of the same anchor. Training unrolls exactly that (EAGLE-3's
training-time test): step 1 over every position, then steps 2..depth on each
row's own hidden state, with a mask over ``[prefill K/V; step-2 K/V; ...]``
that lets row ``t`` of step ``j`` see prefill keys ``<= t`` and only its own row
of later steps. Inputs are teacher-forced tokens of the sequence (the target's
own greedy continuation, so the accepted path). Loss: cross-entropy of step
``j``'s logits against the target's token at position ``t + j + 1``, weighted
``exp(-(j-1)/gamma)``; the first draft matters most, since a miss ends acceptance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from backends.autoregressive.networks import EagleHead
from backends.registry import spread_layers
from backends.training.checkpoint import TrainCheckpoint
from backends.training.data import TargetFeatures, TrainSchedule, as_features, run_adamw
from backends.training.dflash import Labels, decay_weights, trainable
from backends.training.vocab import HeadRows, head_sampler
from specdec.nn.transformer import Transformer


def unroll_mask(rows: int, step: int, device: torch.device) -> Bool[Tensor, "rows keys"]:
    """Keys ``[prefill rows; step-2 rows; ...; step-j rows]``: prefill causally, each later step only its own row."""
    causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    own = torch.eye(rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * (step - 1), dim=1)


def unrolled_hidden(
    head: EagleHead,
    features: Float[Tensor, "batch rows hidden"],
    step_ids: Sequence[Int[Tensor, "batch rows"]],
) -> list[Float[Tensor, "batch rows hidden"]]:
    """Pre-norm hidden states of draft steps 1..len(step_ids) for every row (differentiable, dense).

    ``step_ids[j-1][:, t]`` is the token step ``j`` reads at row ``t`` (position ``t + j - 1``).
    """
    batch, rows, hidden = features.shape
    layer, attn = head.layer, head.layer.self_attn
    device = features.device
    keys: list[Tensor] = []
    values: list[Tensor] = []
    feats = features
    out: list[Tensor] = []
    for j, ids in enumerate(step_ids, start=1):
        positions = (torch.arange(rows, device=device) + (j - 1)).repeat(batch)
        x = head.input_proj(torch.cat([head.target.embed(ids.reshape(-1)), feats.reshape(-1, hidden)], dim=-1))
        q_, k_, v_ = attn.project(layer.input_layernorm(x), positions)
        keys.append(k_.view(batch, rows, *k_.shape[1:]))
        values.append(v_.view(batch, rows, *v_.shape[1:]))
        mixed = F.scaled_dot_product_attention(
            q_.view(batch, rows, *q_.shape[1:]).transpose(1, 2),
            torch.cat(keys, dim=1).transpose(1, 2),
            torch.cat(values, dim=1).transpose(1, 2),
            attn_mask=unroll_mask(rows, j, device)[None, None],
            enable_gqa=True,
        )
        x = x + attn.o_proj(mixed.transpose(1, 2).reshape(batch * rows, attn.num_heads * attn.head_dim))
        h = layer.run_mlp(x, None, None).view(batch, rows, hidden)
        out.append(h)
        feats = h
    return out


def eagle_loss(
    head: EagleHead,
    feats: TargetFeatures,
    index: Int[Tensor, " batch"],
    depth: int,
    gamma: float,
    labels: Labels,
    picked: Int[Tensor, " picked"] | None = None,
    rows_of_head: HeadRows | None = None,
) -> Tensor:
    """Decay-weighted cross-entropy of draft steps 1..depth over every row with a label.

    ``picked`` (flat indices into ``batch x rows``) limits the loss to those
    rows: the shared LM head costs far more per row than the head's own layer,
    so a real-vocabulary run unrolls every row but scores a sample of them.
    ``rows_of_head`` scores against those LM-head rows only (default: all).
    """
    tokens = feats.tokens[index]
    seq_len = tokens.shape[1]
    rows = seq_len - depth - 1  # row t of step depth predicts position t + depth + 1 < seq_len
    if rows < 1:
        raise ValueError(f"sequences of {seq_len} tokens are too short to unroll {depth} draft steps")
    batch, hidden_size = len(index), head.fuse.weight.shape[0]
    dtype = head.fuse.weight.dtype  # features may be stored narrower (bf16)
    flat_aux = [a[index][:, :rows].reshape(batch * rows, hidden_size).to(dtype) for a in feats.aux]
    fused = head.fuse_aux(flat_aux).view(batch, rows, hidden_size)
    step_ids = [tokens[:, j : j + rows] for j in range(1, depth + 1)]
    hidden = unrolled_hidden(head, fused, step_ids)
    weights = decay_weights(depth, gamma, tokens.device)
    total = tokens.new_zeros((), dtype=torch.float32)
    for j, h in enumerate(hidden, start=1):
        flat = h.reshape(-1, h.shape[-1])
        if labels == "greedy":  # the target's argmax for position p is read at position p - 1
            want = feats.greedy_next[index][:, j : j + rows].reshape(-1)
        else:
            want = tokens[:, j + 1 : j + 1 + rows].reshape(-1)
        if picked is not None:
            flat, want = flat[picked], want[picked]
        if rows_of_head is None:
            logits = head.target.compute_logits(head.norm(flat)).float()
        else:
            logits, want = rows_of_head.logits(head.norm(flat)).float(), rows_of_head.index(want)
        total = total + weights[j - 1] * F.cross_entropy(logits, want)
    return total / weights.sum()


def train_eagle(
    head: EagleHead,
    target: Transformer,
    sequences: Int[Tensor, "num seq_len"] | TargetFeatures,
    schedule: TrainSchedule,
    *,
    depth: int = 3,
    gamma: float | None = None,
    labels: Labels = "greedy",
    aux_layers: Sequence[int] | None = None,
    loss_rows: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
) -> list[float]:
    """AdamW on the head's own weights (target embedding and LM head frozen); returns the loss per step.

    ``depth`` is how many draft steps are unrolled (the K it is tuned for).
    ``sequences`` are token ids, or features precomputed by ``target_features``.
    ``schedule`` is the optimisation (steps, learning rate, seed, vocabulary subset...);
    ``loss_rows`` scores that many random rows per batch (default: all).
    Runs on the target's device; nothing here is CPU- or GPU-specific.
    """
    if depth < 1:
        raise ValueError(f"depth (draft steps unrolled) must be >= 1, got {depth}")
    gamma = gamma if gamma is not None else max(1.0, depth / 2)
    aux_layers = tuple(aux_layers) if aux_layers is not None else spread_layers(target.config.num_layers)
    if len(aux_layers) != head.num_aux:
        raise ValueError(f"the EAGLE head fuses {head.num_aux} target layers; aux_layers={aux_layers}")
    feats = as_features(target, sequences, aux_layers)
    rows = feats.tokens.shape[1] - depth - 1
    if loss_rows is not None and loss_rows < 1:
        raise ValueError(f"loss_rows must be >= 1, got {loss_rows}")

    sampler = head_sampler(
        target, feats, keep_top=schedule.keep_top, negatives=schedule.negatives, dtype=schedule.autocast
    )

    def batch_loss(index: Tensor, g: torch.Generator) -> Tensor:
        head_rows = None if sampler.full else sampler.rows(g)
        picked = None
        total = len(index) * rows
        if loss_rows is not None and loss_rows < total:
            picked = torch.randperm(total, generator=g)[:loss_rows].to(index.device)
        return eagle_loss(head, feats, index, depth, gamma, labels, picked, head_rows)

    with trainable(head) as params:  # the target is held outside the head's parameters
        return run_adamw(
            params,
            schedule,
            num_sequences=feats.tokens.shape[0],
            batch_loss=batch_loss,
            name="EAGLE",
            on_step=on_step,
            checkpoint=checkpoint,
        )
