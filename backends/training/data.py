"""Training data for drafters: target-generated continuations and the frozen target's per-position features."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from specdec.model.transformer import Transformer


@torch.no_grad()
def generate_sequences(
    target: Transformer, num: int, *, prompt_len: int, gen_len: int, seed: int
) -> Int[Tensor, "num seq_len"]:
    """Random prompts continued greedily by the target itself.

    Self-distillation data: a drafter trained on the target's own greedy
    continuations learns exactly what greedy verification accepts.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    vocab = target.config.vocab_size
    out = torch.randint(0, vocab, (num, prompt_len), generator=g).to(target.device)
    rows = []
    for i in range(num):
        seq = out[i]
        for _ in range(gen_len):
            logits = target.compute_logits(target.forward_dense(seq).hidden_states[-1:])
            seq = torch.cat([seq, logits.argmax(-1)])
        rows.append(seq)
    return torch.stack(rows)


@dataclass(frozen=True, eq=False)
class TargetFeatures:
    """Per-position frozen target outputs of a batch of equal-length sequences, computed once before training."""

    tokens: Int[Tensor, "num seq_len"]
    aux: tuple[Float[Tensor, "num seq_len hidden"], ...]
    """Outputs of the drafter's ``aux_layers`` (what inference injects)."""
    logits: Float[Tensor, "num seq_len vocab"]
    """Target logits at each position: the distribution of the token at the next position."""

    @property
    def greedy_next(self) -> Int[Tensor, "num seq_len"]:
        """The target's own argmax next token at each position (the self-distillation label)."""
        return self.logits.argmax(-1)


@torch.no_grad()
def target_features(
    target: Transformer, tokens: Int[Tensor, "num seq_len"], aux_layers: Sequence[int]
) -> TargetFeatures:
    """Run the frozen target densely over each sequence (no cache), keeping aux hidden states and logits."""
    aux: list[list[Tensor]] = [[] for _ in aux_layers]
    logits = []
    for seq in tokens:
        out = target.forward_dense(seq, aux_layers=aux_layers)
        for j, h in enumerate(out.aux_hidden_states):
            aux[j].append(h)
        logits.append(target.compute_logits(out.hidden_states))
    return TargetFeatures(tokens, tuple(torch.stack(a) for a in aux), torch.stack(logits))


def run_adamw(
    params: Sequence[torch.nn.Parameter],
    *,
    steps: int,
    lr: float,
    num_sequences: int,
    batch_size: int,
    seed: int,
    batch_loss: Callable[[Int[Tensor, " batch"], torch.Generator], Tensor],
    name: str,
) -> list[float]:
    """The optimisation loop every drafter trainer shares: sample sequences, step AdamW, stop on divergence.

    ``batch_loss`` gets the sampled sequence indices and the CPU generator (for
    anchors), so a run is reproducible from ``seed`` on any device.
    """
    device = params[0].device if params else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(seed)
    losses: list[float] = []
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        index = torch.randint(0, num_sequences, (min(batch_size, num_sequences),), generator=g).to(device)
        loss = batch_loss(index, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{name} training diverged at step {len(losses)}: loss {losses[-1]}")
    return losses
