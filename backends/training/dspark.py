"""DSpark training: the DFlash backbone in the anchor-first layout plus the Markov and confidence heads.

Block ``[t_a, MASK x (q-1)]`` at positions ``a .. a+q-1``; slot i predicts the
token at ``a+i+1`` from ``U_i + W2·W1[x_i]`` (x_0 = anchor, then the label of
the slot before: teacher forcing on the accepted path). Loss per slot, weighted
``exp(-(k-1)/gamma)`` with k = i+1: cross-entropy + total variation to the
target's distribution (coarsened to its stored top tokens, ``coarse_tv``) + BCE
of the confidence against ``1 - TV`` (the probability a sampled draft is accepted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from backends.dflash.network import MASK_TOKEN_ID, DFlashNetwork
from backends.dspark.heads import DSparkHeads
from backends.training.checkpoint import TrainCheckpoint
from backends.training.data import TargetFeatures, TrainSchedule, as_features, run_adamw
from backends.training.dflash import (
    Labels,
    block_hidden,
    decay_weights,
    default_aux_layers,
    sample_anchors,
    trainable,
)
from backends.training.vocab import HeadRows, head_sampler
from specdec.nn.transformer import Transformer


def coarse_tv(
    p_draft: Float[Tensor, "n vocab"], top_ids: Int[Tensor, "n top"], top_probs: Float[Tensor, "n top"]
) -> Float[Tensor, " n"]:
    """Total variation between the draft and the target coarsened to ``top`` tokens plus one "other" bucket.

    The features keep only the target's top tokens (full logits do not fit at a
    real vocabulary); this lower bound of the true TV is exact when the top
    tokens carry all of the target's mass (as with a vocabulary of at most ``top``).
    """
    draft_top = p_draft.gather(1, top_ids)
    rest = (top_probs.sum(-1) - draft_top.sum(-1)).abs()  # |(1 - sum draft) - (1 - sum target)|
    return 0.5 * ((draft_top - top_probs).abs().sum(-1) + rest)


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
    head_rows: HeadRows | None = None,
) -> Tensor:
    """Decay-weighted CE + TV + confidence BCE over the q slots of every anchor's block.

    ``head_rows`` scores against those LM-head (and Markov) rows only; they must
    hold the target's top tokens of the features (default: the whole vocabulary).
    """
    tokens = feats.tokens[index]
    batch, num_anchors = anchors.shape
    pos = anchors[:, :, None] + torch.arange(q, device=tokens.device)  # slot i reads position a+i
    block_ids = torch.full_like(pos, MASK_TOKEN_ID)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    aux = [a[index].to(network.fc.weight.dtype) for a in feats.aux]  # features may be stored as bf16
    hidden = block_hidden(network, aux, block_ids.view(batch, -1), anchors, q)
    flat_pos = pos.reshape(batch, -1)
    if labels == "greedy":
        want = feats.greedy_next[index].gather(1, flat_pos)
    else:
        want = tokens.gather(1, flat_pos + 1)
    want = want.view(batch, num_anchors, q)
    prev = torch.cat([block_ids[:, :, :1], want[:, :, :-1]], dim=2).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    top = feats.top_ids.shape[-1]
    top_ids = feats.top_ids[index].gather(1, flat_pos[:, :, None].expand(-1, -1, top)).reshape(-1, top)
    top_p = feats.top_probs[index].gather(1, flat_pos[:, :, None].expand(-1, -1, top)).reshape(-1, top).float()
    if head_rows is None:
        backbone = network.target.compute_logits(network.norm(flat))
        markov = heads.markov_bias(prev)
    else:
        backbone = head_rows.logits(network.norm(flat))
        markov = heads.embed_prev(prev) @ heads.w2[head_rows.ids].T
        want, top_ids = head_rows.index(want), head_rows.index(top_ids)
    logits = backbone.float() + markov.float()
    p_draft = torch.softmax(logits, dim=-1)
    ce = F.cross_entropy(logits, want.reshape(-1), reduction="none")
    tv = coarse_tv(p_draft, top_ids, top_p)
    conf = heads.confidence(flat, prev).float().clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(conf, (1.0 - tv).detach(), reduction="none")
    w = decay_weights(q, gamma, tokens.device).repeat(batch * num_anchors)
    return ((ce + tv_weight * tv + conf_weight * bce) * w).sum() / w.sum()


def train_dspark(
    network: DFlashNetwork,
    heads: DSparkHeads,
    target: Transformer,
    sequences: Int[Tensor, "num seq_len"] | TargetFeatures,
    schedule: TrainSchedule,
    *,
    block_size: int = 4,
    anchors_per_seq: int = 8,
    gamma: float | None = None,
    labels: Labels = "greedy",
    tv_weight: float = 1.0,
    conf_weight: float = 1.0,
    aux_layers: Sequence[int] | None = None,
    min_anchor: int = 1,
    on_step: Callable[[int, float], None] | None = None,
    checkpoint: TrainCheckpoint | None = None,
) -> list[float]:
    """AdamW on the backbone and both heads (target frozen); ``block_size`` is q = K. Returns losses per step.

    ``schedule.keep_top``/``negatives`` score against a vocabulary subset (``head_sampler``);
    the TV term needs every top token of the features kept, so ``keep_top`` must be all of them.
    """
    q = block_size
    gamma = gamma if gamma is not None else max(1.0, q / 2)
    device = target.device
    aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(network, target)
    feats = as_features(target, sequences, aux_layers)
    num, seq_len = feats.tokens.shape
    high = seq_len - q - (1 if labels == "data" else 0)

    keep_top = schedule.keep_top
    if keep_top is not None and keep_top != feats.top_ids.shape[-1]:
        raise ValueError(f"DSpark's TV term reads all {feats.top_ids.shape[-1]} top tokens; keep_top={keep_top}")
    sampler = head_sampler(target, feats, keep_top=keep_top, negatives=schedule.negatives, dtype=schedule.autocast)

    def batch_loss(index: Tensor, g: torch.Generator) -> Tensor:
        anchors = sample_anchors(len(index), anchors_per_seq, min_anchor, high, g, device)
        head_rows = None if sampler.full else sampler.rows(g)
        return dspark_loss(network, heads, feats, index, anchors, q, gamma, labels, tv_weight, conf_weight, head_rows)

    with trainable(network, heads) as params:
        return run_adamw(
            params,
            schedule,
            num_sequences=num,
            batch_loss=batch_loss,
            name="DSpark",
            on_step=on_step,
            checkpoint=checkpoint,
        )
