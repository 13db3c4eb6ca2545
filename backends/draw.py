"""How a drafter turns draft logits into drafts: the one sampling rule every shipped drafter uses.

Drafts must come from the distribution handed to the verifier (VER-3), so a
sampled draft is drawn from the verifier's own transform of the logits
(temperature, top-k, top-p). Greedy requests, and a drafter asked for
``argmax_drafts``, take the argmax instead: their proposal is one-hot anyway,
and a multinomial draw over the vocabulary cost about 1 ms a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from contracts import ProposalSourceEvidence
from specdec.sampling import SamplingParams, probabilities, sample


def draw_drafts(
    logits: Float[Tensor, "n vocab"],
    params: list[SamplingParams],
    generator: torch.Generator,
    *,
    argmax_drafts: bool = False,
) -> tuple[Int[Tensor, " n"], Float[Tensor, "n vocab"]]:
    """One draft per row of ``logits`` (``params`` per row) and the distribution it was drawn from."""
    if not params:
        return torch.zeros(0, dtype=torch.int64, device=logits.device), logits.softmax(-1)
    if argmax_drafts or all(p.greedy for p in params):
        best = logits.argmax(-1)
        return best, torch.nn.functional.one_hot(best, logits.shape[-1]).to(torch.float32)
    probs = probabilities(logits, params)
    return sample(probs, generator), probs


def proposal_source(
    logits: Float[Tensor, "rows k vocab"], num_drafts: Sequence[int], params: Sequence[SamplingParams]
) -> ProposalSourceEvidence:
    """What a drafter reports so that VER-9 can recompute its proposal: the logits and each row's settings."""
    return ProposalSourceEvidence(
        logits=logits,
        num_drafts=tuple(num_drafts),
        temperature=tuple(p.temperature for p in params),
        top_k=tuple(p.top_k for p in params),
        top_p=tuple(p.top_p for p in params),
    )
