"""The shared draft-drawing rule: argmax for greedy rows and argmax drafts, else the verifier's own transform."""

from __future__ import annotations

import torch

from backends.draw import argmax_proposal, draw_drafts
from specdec.sampling import SamplingParams, probabilities, sample

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.7, top_k=3)


def _logits() -> torch.Tensor:
    return torch.randn((4, 11), generator=torch.Generator().manual_seed(0))


def test_greedy_rows_and_argmax_drafts_take_the_argmax_and_build_no_proposal() -> None:
    """Their proposal is one-hot and never handed to the verifier: building one cost ~2 ms a step at batch 8."""
    logits = _logits()
    for params, argmax in (([GREEDY] * 4, False), ([WARM] * 4, True)):
        assert argmax_proposal(params, argmax_drafts=argmax)
        drawn, probs = draw_drafts(logits, params, torch.Generator().manual_seed(1), argmax_drafts=argmax)
        assert torch.equal(drawn, logits.argmax(-1))
        assert probs is None
    assert not argmax_proposal([GREEDY, WARM])  # one sampled row: every row's proposal is handed over


def test_sampled_rows_come_from_the_verifiers_transform_with_the_drafters_generator() -> None:
    logits, params = _logits(), [WARM, GREEDY, WARM, WARM]
    drawn, probs = draw_drafts(logits, params, torch.Generator().manual_seed(5))
    want = probabilities(logits, params)
    assert probs is not None and torch.equal(probs, want)
    assert torch.equal(drawn, sample(want, torch.Generator().manual_seed(5)))
    assert int(drawn[1]) == int(logits[1].argmax())


def test_no_rows_draw_nothing() -> None:
    drawn, probs = draw_drafts(torch.zeros((0, 11)), [], torch.Generator())
    assert drawn.shape == (0,) and drawn.dtype == torch.int64 and probs is not None and probs.shape == (0, 11)
