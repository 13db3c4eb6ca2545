"""How a drafter turns draft logits into drafts: the one sampling rule every shipped drafter uses.

Drafts must come from the distribution handed to the verifier (VER-3), so a
sampled draft is drawn from the verifier's own transform of the logits
(temperature, top-k, top-p). Greedy requests, and a drafter asked for
``argmax_drafts``, take the argmax instead: their proposal is one-hot anyway,
and a multinomial draw over the vocabulary cost about 1 ms a row. Such a
proposal is never handed over (the verifier compares tokens), so no
distribution is built for it: a one-hot row over a 49k vocabulary is
~0.6 MB of writes, and a batch of 8 drafting 4 tokens paid ~2 ms a step for
rows nobody read.
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
    ids: Int[Tensor, " draft_vocab"] | None = None,
) -> tuple[Int[Tensor, " n"], Float[Tensor, "n vocab"] | None]:
    """One draft per row of ``logits`` (``params`` per row) and the distribution it was drawn from.

    The distribution is None where every row took the argmax (``argmax_proposal``).
    ``ids``: the sorted columns where the logits can be finite (a draft
    vocabulary; ``-inf`` everywhere else). Those others can be neither drawn nor
    proposed, so the transform and the draw run on ``ids`` alone (4,096 columns
    instead of 49,152) and the distribution is scattered back to full width with
    zeros elsewhere: the same distribution, since the transform gives ``-inf``
    no mass, and the same argmax, since sorted ids break ties alike.
    """
    if ids is None:
        return _draw(logits, params, generator, argmax_drafts=argmax_drafts)
    ids = ids.to(logits.device)
    return draw_on_ids(logits[:, ids], ids, logits.shape[-1], params, generator, argmax_drafts=argmax_drafts)


def draw_on_ids(
    logits: Float[Tensor, "n draft_vocab"],
    ids: Int[Tensor, " draft_vocab"],
    vocab_size: int,
    params: list[SamplingParams],
    generator: torch.Generator,
    *,
    argmax_drafts: bool = False,
) -> tuple[Int[Tensor, " n"], Float[Tensor, "n vocab"] | None]:
    """``draw_drafts`` of logits given on the columns ``ids`` only: drafts as target ids, the distribution full width."""
    drafts, probs = _draw(logits, params, generator, argmax_drafts=argmax_drafts)
    if probs is None:
        return ids[drafts], None
    full = torch.zeros((probs.shape[0], vocab_size), dtype=probs.dtype, device=probs.device)
    return ids[drafts], full.index_copy_(1, ids, probs)


def _draw(
    logits: Float[Tensor, "n width"], params: list[SamplingParams], generator: torch.Generator, *, argmax_drafts: bool
) -> tuple[Int[Tensor, " n"], Float[Tensor, "n width"] | None]:
    if not params:
        return torch.zeros(0, dtype=torch.int64, device=logits.device), logits.softmax(-1)
    if argmax_proposal(params, argmax_drafts=argmax_drafts):
        return logits.argmax(-1), None
    probs = probabilities(logits, params)
    return sample(probs, generator), probs


def argmax_proposal(params: Sequence[SamplingParams], *, argmax_drafts: bool = False) -> bool:
    """Whether drafts for these rows are argmaxes: a one-hot proposal, so none is handed to the verifier."""
    return argmax_drafts or all(p.greedy for p in params)


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
