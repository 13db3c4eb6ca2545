"""``sample`` draws by inverse CDF: each token exactly as often as its probability, never one of probability 0.

``tokens_at`` is the arithmetic with the uniform given, so its intervals are
checked exactly: at chosen points (boundaries included) and, by Hypothesis,
at the midpoint of a random token's interval computed in exact rationals from
the float32 probabilities, over rows that mix masses of 0.5 with ones of 1e-8
and 1e-30 (float32 running sums give such tokens no interval at all).
``sample`` is checked by Pearson's chi-square at significance ALPHA = 0.001
with fixed seeds, on normalised and unnormalised rows. The search runs block by
block (``SEARCH_BLOCK`` tokens); the tests shrink the block to a few tokens so
that their short rows span several, the last one partial or not.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chisquare

import specdec.sampling as sampling
from specdec.sampling import InvalidDistributionError, sample, tokens_at

ALPHA = 1e-3
"""Significance level of the chi-square tests in this module."""
N_DRAWS = 40_000


def _at(row: list[float], u: float) -> int:
    return int(tokens_at(torch.tensor([row]), torch.tensor([u], dtype=torch.float64))[0])


BLOCKS = [1, 2, 3, 4, 256]
"""Search block sizes: a row of a few tokens then spans several blocks, with and without a partial last one."""


@pytest.fixture(params=BLOCKS)
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sampling, "SEARCH_BLOCK", request.param)
    return int(request.param)


@pytest.mark.usefixtures("block")
def test_intervals_are_half_open_and_skip_tokens_without_mass() -> None:
    row = [0.25, 0.0, 0.5, 0.0, 0.25, 0.0]  # dyadic: every boundary is exact
    assert [_at(row, u) for u in (0.0, 0.2, 0.25, 0.7, 0.75, 0.99)] == [0, 0, 2, 2, 4, 4]
    assert _at(row, 1.0 - 2.0**-53) == 4
    assert _at(row, 1.0) == 4  # u * mass rounding up to the mass: the last token with mass, not the zeros after it
    assert _at([0.0, 0.0, 3.0, 1.0], 0.0) == 2  # zeros first; rows need not sum to 1
    assert _at([0.0, 0.0, 3.0, 1.0], 0.75) == 3


@pytest.mark.usefixtures("block")
def test_a_tiny_mass_after_a_large_one_keeps_its_interval() -> None:
    row = [0.75, 2e-8, 0.25]  # 0.75 + 2e-8 rounds back to 0.75 in float32
    p = [Fraction(float(x)) for x in torch.tensor(row)]
    middle = (p[0] + p[1] / 2) / sum(p)
    assert _at(row, float(middle)) == 1


MASSES = st.sampled_from([0.0, 0.0, 0.0, 1e-30, 1e-8, 2e-8, 1e-3, 0.1, 0.5, 1.0, 3.0])


@given(
    rows=st.lists(st.lists(MASSES, min_size=1, max_size=40), min_size=1, max_size=4),
    picks=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=4, max_size=4),
    block=st.sampled_from(BLOCKS),
)
def test_the_midpoint_of_each_tokens_exact_interval_draws_that_token(
    rows: list[list[float]], picks: list[float], block: int
) -> None:
    vocab = max(len(r) for r in rows)
    rows = [r + [0.0] * (vocab - len(r)) for r in rows]
    rows = [r if any(r) else [1.0, *r[1:]] for r in rows]
    probs = torch.tensor(rows)  # float32, as the engine's distributions
    u, want = [], []
    for r, pick in zip(probs.tolist(), picks, strict=False):
        exact = [Fraction(x) for x in r]
        # Masses below ~1e-16 of the row's have no float64 interval either; those are no draw's target.
        support = [i for i, x in enumerate(exact) if x > sum(exact) * Fraction(1, 2**40)]
        token = support[int(pick * len(support))]
        u.append(float((sum(exact[:token]) + exact[token] / 2) / sum(exact)))
        want.append(token)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "SEARCH_BLOCK", block)
        got = tokens_at(probs[: len(u)], torch.tensor(u, dtype=torch.float64))
    assert got.tolist() == want


@given(
    rows=st.lists(st.lists(MASSES, min_size=2, max_size=64), min_size=1, max_size=8),
    seed=st.integers(0, 2**31),
    block=st.sampled_from(BLOCKS),
)
def test_sample_never_draws_a_token_without_mass_nor_falls_back(rows: list[list[float]], seed: int, block: int) -> None:
    vocab = max(len(r) for r in rows)
    probs = torch.tensor([(r + [0.0] * vocab)[:vocab] if any(r) else [0.0] * (vocab - 1) + [1.0] for r in rows])
    fallbacks: list[int] = []
    real = torch.multinomial
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "multinomial", lambda p, *a, **k: fallbacks.append(p.shape[0]) or real(p, *a, **k))
        patch.setattr(sampling, "SEARCH_BLOCK", block)
        tokens = sample(probs.repeat(16, 1), torch.Generator().manual_seed(seed))
    assert bool((probs.repeat(16, 1).gather(-1, tokens[:, None]) > 0).all())
    assert fallbacks == []


@pytest.mark.parametrize(
    "row",
    [
        [0.1, 0.0, 0.6, 0.3, 0.0],
        [3.0, 1.0, 0.0, 0.5, 0.5],  # unnormalised weights, as torch.multinomial takes them
        [1e-3, 0.2, 0.0, 1e-2, 0.789],
    ],
)
@pytest.mark.parametrize("block", [2, 3, 256])
def test_sample_follows_the_distribution(row: list[float], block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "SEARCH_BLOCK", block)
    probs = torch.tensor(row)
    draws = sample(probs.expand(N_DRAWS, -1), torch.Generator().manual_seed(11))
    counts = torch.bincount(draws, minlength=len(row)).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    weights = probs[support].double()
    assert chisquare(counts[support].numpy(), (weights / weights.sum() * counts.sum()).numpy()).pvalue > ALPHA


def test_a_draw_without_mass_is_drawn_again_by_multinomial(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan that rounded a zero-probability token's interval open would land there: that row is redrawn."""
    probs = torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.2, 0.0, 0.8]])
    real_draw = sampling._tokens_and_mass
    monkeypatch.setattr(sampling, "_tokens_and_mass", lambda p, u: (torch.tensor([1, 0, 1]), real_draw(p, u)[1]))
    redrawn: list[list[float]] = []
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **k: redrawn.append(p.tolist()) or real(p, *a, **k))
    for seed in range(20):
        tokens = sample(probs, torch.Generator().manual_seed(seed)).tolist()
        assert tokens[0] == 1 and tokens[1] == 1 and tokens[2] in (0, 2)
    assert redrawn[0] == probs[1:].tolist()  # the two rows whose draw had no mass, and only those


def test_a_negative_entry_is_an_error_even_where_the_draw_has_mass() -> None:
    with pytest.raises(InvalidDistributionError, match=r"1 of 1 rows.*row 0: negative"):
        sample(torch.tensor([[-0.25, 1.25]]), torch.Generator().manual_seed(0))


def test_meta_and_fake_tensors_draw_without_reading_values() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert sample(torch.empty(3, 7, device="meta")).shape == (3,)
    with FakeTensorMode():
        assert sample(torch.rand(2, 5).softmax(-1)).shape == (2,)
    assert sample(torch.empty(0, 7)).shape == (0,)
