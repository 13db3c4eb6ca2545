"""The shared draft-drawing rule: argmax for greedy rows and argmax drafts, else the verifier's own transform."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    size=st.integers(1, 23),
    rows=st.integers(0, 4),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([None, 1, 3, 40]),
    top_p=st.sampled_from([None, 0.6, 1.0]),
)
def test_a_draw_on_the_draft_ids_equals_the_full_width_draw(
    seed: int, size: int, rows: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Logits -inf off a draft vocabulary: the same argmax (ties too), the same proposal, drafts as target ids."""
    vocab = 23
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:size].sort().values
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, ids] = torch.randint(-2, 3, (rows, size), generator=g).float()  # small integers: ties are common
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * rows
    drafts, probs = draw_drafts(logits, params, torch.Generator().manual_seed(seed), ids=ids)
    assert drafts.shape == (rows,) and set(drafts.tolist()) <= set(ids.tolist())
    if rows == 0:
        assert probs is not None and probs.shape == (0, vocab)
    elif temperature == 0.0:
        assert probs is None and drafts.tolist() == logits.argmax(-1).tolist()
    else:
        assert probs is not None and probs.shape == (rows, vocab)
        torch.testing.assert_close(probs, probabilities(logits, params), atol=1e-6, rtol=1e-5)
        assert bool((probs[torch.arange(rows), drafts] > 0).all())
