"""DSpark training: the DFlash backbone in the anchor-first layout plus the Markov and confidence heads.

Block ``[t_a, MASK x (q-1)]`` at positions ``a .. a+q-1``; slot i predicts the
token at ``a+i+1`` from ``U_i + W2·W1[x_i]`` (x_0 = anchor, then the label of
the slot before: teacher forcing on the accepted path). Loss per slot, weighted
``exp(-(k-1)/gamma)`` with k = i+1: cross-entropy + total variation to the
target's distribution + BCE of the confidence against ``1 - TV`` (the
probability a sampled draft is accepted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor

from backends.dflash.network import MASK_TOKEN_ID, DFlashNetwork
from backends.dspark.heads import DSparkHeads
from backends.training.data import TargetFeatures, run_adamw, target_features
from backends.training.dflash import (
    Labels,
    block_hidden,
    decay_weights,
    default_aux_layers,
    sample_anchors,
    trainable,
)
from specdec.model.transformer import Transformer


def dspark_loss(
    network: DFlashNetwork,
    heads: DSparkHeads,
    feats: TargetFeatures,
    index: Int[Tensor, " batch"],
    anchors: Int[Tensor, "batch num_anchors"],
    q: int,
    gamma: float,
    labels: Labels,
    tv_weight: float,
    conf_weight: float,
) -> Tensor:
    """Decay-weighted CE + TV + confidence BCE over the q slots of every anchor's block."""
    tokens = feats.tokens[index]
    batch, num_anchors = anchors.shape
    pos = anchors[:, :, None] + torch.arange(q, device=tokens.device)  # slot i reads position a+i
    block_ids = torch.full_like(pos, MASK_TOKEN_ID)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    hidden = block_hidden(network, [a[index] for a in feats.aux], block_ids.view(batch, -1), anchors, q)
    flat_pos = pos.reshape(batch, -1)
    if labels == "greedy":
        want = feats.greedy_next[index].gather(1, flat_pos)
    else:
        want = tokens.gather(1, flat_pos + 1)
    want = want.view(batch, num_anchors, q)
    prev = torch.cat([block_ids[:, :, :1], want[:, :, :-1]], dim=2).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    backbone = network.target.compute_logits(network.norm(flat))
    logits = backbone.float() + heads.markov_bias(prev).float()
    vocab = logits.shape[-1]
    p_target = torch.softmax(feats.logits[index].float(), dim=-1)
    p_target = p_target.gather(1, flat_pos[:, :, None].expand(-1, -1, vocab)).reshape(-1, vocab)
    p_draft = torch.softmax(logits, dim=-1)
    ce = F.cross_entropy(logits, want.reshape(-1), reduction="none")
    tv = 0.5 * (p_draft - p_target).abs().sum(-1)
    conf = heads.confidence(flat, prev).float().clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(conf, (1.0 - tv).detach(), reduction="none")
    w = decay_weights(q, gamma, tokens.device).repeat(batch * num_anchors)
    return ((ce + tv_weight * tv + conf_weight * bce) * w).sum() / w.sum()


def train_dspark(
    network: DFlashNetwork,
    heads: DSparkHeads,
    target: Transformer,
    sequences: Int[Tensor, "num seq_len"],
    *,
    steps: int,
    lr: float = 3e-3,
    block_size: int = 4,
    seed: int = 0,
    batch_size: int = 8,
    anchors_per_seq: int = 8,
    gamma: float | None = None,
    labels: Labels = "greedy",
    tv_weight: float = 1.0,
    conf_weight: float = 1.0,
    aux_layers: Sequence[int] | None = None,
    min_anchor: int = 1,
) -> list[float]:
    """AdamW on the backbone and both heads (target frozen); ``block_size`` is q = K. Returns losses per step."""
    q = block_size
    gamma = gamma if gamma is not None else max(1.0, q / 2)
    device = target.device
    aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(network, target)
    feats = target_features(target, sequences.to(device), aux_layers)
    num, seq_len = sequences.shape
    high = seq_len - q - (1 if labels == "data" else 0)

    def batch_loss(index: Tensor, g: torch.Generator) -> Tensor:
        anchors = sample_anchors(len(index), anchors_per_seq, min_anchor, high, g, device)
        return dspark_loss(network, heads, feats, index, anchors, q, gamma, labels, tv_weight, conf_weight)

    with trainable(network, heads) as params:
        return run_adamw(
            params,
            steps=steps,
            lr=lr,
            num_sequences=num,
            batch_size=batch_size,
            seed=seed,
            batch_loss=batch_loss,
            name="DSpark",
        )
