"""The verifier's distribution invariants (VER-4 to VER-7) and what happens without them.

Each invariant is shown silent on a correct input and firing on a planted
fault; the [D] ones (VER-5 to VER-7) only in ``full``. The statistical tests
use Pearson's chi-square at significance level ALPHA = 0.001 with fixed seeds,
as ``test_verifier.py`` does: an unnormalised proposal visibly biases the
output when unchecked (p-value < ALPHA) and is a ContractViolation in ``full``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from jaxtyping import config as jaxtyping_config
from pydantic import ValidationError
from scipy.stats import chisquare

import contracts
from contracts import REJECTED_TOKEN_ID, ContractViolation, VerifierInput, VerifierOutput
from contracts.invariants.verifier import PROPOSAL_SUM_ATOL
from specdec.sampling import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    InvalidDistributionError,
    SamplingParams,
    probabilities,
    sample,
)
from specdec.verifier import verify

ALPHA = 1e-3
"""Significance level of every chi-square test in this module."""
N_TRIALS = 20_000
PLAIN = SamplingParams()
GREEDY = SamplingParams(temperature=0.0)
VOCAB, K = 5, 2
NUM_DRAFT = [2, 1, 0]


def _case(draft_probs: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> VerifierInput:
    """Three requests with 2, 1 and 0 drafts over a 5-token vocabulary; slots past a request's drafts are pads."""
    g = torch.Generator().manual_seed(0)
    drafts = torch.tensor([[1, 2], [3, REJECTED_TOKEN_ID], [REJECTED_TOKEN_ID, REJECTED_TOKEN_ID]])
    if logits is None:
        logits = torch.randn(sum(NUM_DRAFT) + len(NUM_DRAFT), VOCAB, generator=g)
    return VerifierInput(drafts, torch.tensor(NUM_DRAFT), logits, draft_probs)


def _proposal() -> torch.Tensor:
    """A correct proposal on the drafted slots, zeros elsewhere (as the engine builds it)."""
    q = torch.zeros(len(NUM_DRAFT), K, VOCAB)
    q[0, 0] = q[0, 1] = q[1, 0] = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25])
    return q


def _run(
    inp: VerifierInput, sampled_from: torch.Tensor | None = None, params: SamplingParams = PLAIN
) -> VerifierOutput:
    drawn = inp.draft_probs if sampled_from is None else sampled_from
    return verify(
        inp,
        [params] * len(NUM_DRAFT),
        num_spec_tokens=K,
        num_draft_tokens=NUM_DRAFT,
        generator=torch.Generator().manual_seed(1),
        sampled_from=drawn,
    )


def _caught(mode: str, call: Callable[[], object]) -> ContractViolation | None:
    with contracts.enforce(mode):
        try:
            call()
        except ContractViolation as err:
            return err
    return None


def _caught_id(mode: str, call: Callable[[], object]) -> str | None:
    err = _caught(mode, call)
    return None if err is None else err.invariant_id


# -- silent on correct inputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [PLAIN, GREEDY, SamplingParams(temperature=0.7, top_k=3)], ids=str)
def test_correct_inputs_pass_every_check(params: SamplingParams) -> None:
    q = _proposal()
    masked = _case().target_logits.clone()
    masked[:, -1] = float("-inf")  # a masked token (padded vocabulary): accepted by VER-5
    for inp in (_case(q), _case(None), _case(q, masked)):
        assert _caught("full", lambda inp=inp: _run(inp, params=params)) is None  # type: ignore[misc]
    # a proposal rounded to bfloat16 on its way still sums to 1 within the tolerance
    rounded = torch.softmax(torch.randn(len(NUM_DRAFT), K, 1000, generator=torch.Generator().manual_seed(2)), -1)
    rounded = rounded.bfloat16().float()
    assert (rounded.sum(-1) - 1).abs().max() <= PROPOSAL_SUM_ATOL
    wide = VerifierInput(
        _case().draft_token_ids, torch.tensor(NUM_DRAFT), torch.randn(sum(NUM_DRAFT) + 3, 1000), rounded
    )
    assert _caught("full", lambda: _run(wide)) is None


# -- VER-4: shapes and dtypes, in shapes mode -----------------------------------------------------------------------


@pytest.fixture
def without_annotation_checks() -> Iterator[None]:
    """The test suite's import hook rejects these dtypes at construction; in production only VER-4 sees them."""
    previous = jaxtyping_config.jaxtyping_disable
    jaxtyping_config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping_config.update("jaxtyping_disable", previous)


@pytest.mark.usefixtures("without_annotation_checks")
def test_ver4_names_wrong_dtypes_and_shapes_in_shapes_mode() -> None:
    q = _proposal()
    plants = {
        "integer proposal (new_zeros on the ids)": (_case(q.long()), q.long()),
        "proposal sized K + 1": (_case(torch.cat([q, q[:, :1]], 1)), torch.cat([q, q[:, :1]], 1)),
        "proposal over a smaller (draft) vocabulary": (_case(q[..., :4]), q[..., :4]),
        "sampled_from integer": (_case(q), q.long()),
    }
    for name, (inp, drawn) in plants.items():
        err = _caught("shapes", lambda inp=inp, drawn=drawn: _run(inp, drawn))  # type: ignore[misc]
        assert err is not None and err.invariant_id == "VER-4", name
        assert "expected" in err.observed
    float_ids = VerifierInput(_case().draft_token_ids.float(), torch.tensor(NUM_DRAFT), _case().target_logits)
    assert _caught_id("shapes", lambda: _run(float_ids)) == "VER-4"
    int_logits = _case(None, _case().target_logits.long())
    err = _caught("shapes", lambda: _run(int_logits, params=GREEDY))
    assert err is not None and err.invariant_id == "VER-4" and "target_logits" in err.observed


# -- VER-5: finite target logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["one NaN", "all NaN", "+inf", "every token masked"])
def test_ver5_non_finite_target_logits(fault: str) -> None:
    logits = _case().target_logits.clone()
    row = 3  # request 1's first row
    if fault == "one NaN":
        logits[row, 2] = float("nan")
    elif fault == "all NaN":
        logits[row] = float("nan")
    elif fault == "+inf":
        logits[row, 0] = float("inf")
    else:
        logits[row] = float("-inf")
    for params in (GREEDY, PLAIN):
        call = lambda params=params: _run(_case(_proposal(), logits), params=params)  # noqa: E731
        assert _caught("shapes", call) is None or params is PLAIN  # [D]: shapes mode reads no values
        err = _caught("full", call)
        assert err is not None and err.invariant_id == "VER-5"
        assert err.observed["logits rows"] == [row] and err.observed["(request, position)"] == [(1, 0)]


@pytest.mark.parametrize("params", [GREEDY, PLAIN], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["off", "shapes"])
def test_unchecked_non_finite_logits_emit_no_token(params: SamplingParams, mode: str) -> None:
    """Without VER-5 the request gets an all-sentinel row (greedy used to emit token 0), and sampling does not crash."""
    logits = _case().target_logits.clone()
    logits[3] = float("nan")
    with contracts.enforce(mode):
        out = _run(_case(_proposal(), logits), params=params)
    assert out.output_token_ids[1].tolist() == [REJECTED_TOKEN_ID] * (K + 1)
    assert int(out.num_accepted[1]) == 0
    for r in (0, 2):  # the other requests are untouched
        assert int(out.output_token_ids[r, int(out.num_accepted[r])]) >= 0


# -- VER-6: proposals are distributions -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["halved", "top-k not renormalised", "NaN", "negative", "inf"])
def test_ver6_proposal_that_is_not_a_distribution(fault: str) -> None:
    q = _proposal()
    if fault == "halved":
        q[1, 0] /= 2
    elif fault == "top-k not renormalised":
        q[1, 0, :3] = 0.0  # keeps the two most likely tokens (0.15 + 0.25) and forgets to renormalise
        q[1, 0, 3] = 1.0  # the draft (3) keeps mass: only VER-6 can tell
    elif fault == "NaN":
        q[1, 0, 4] = float("nan")
    elif fault == "negative":
        q[1, 0, 0], q[1, 0, 1] = -0.1, 0.5
    else:
        q[1, 0, 4] = float("inf")
    assert _caught("shapes", lambda: _run(_case(q))) is None  # [D]
    err = _caught("full", lambda: _run(_case(q)))
    assert err is not None and err.invariant_id == "VER-6"
    assert err.observed["tensor"] == "draft_probs" and err.observed["(request, draft slot)"] == [(1, 0)]


def test_ver6_checks_sampled_from_and_ignores_slots_without_drafts() -> None:
    q, drawn = _proposal(), _proposal()
    drawn[0, 1] *= 0.5  # what the drafter drew from is not a distribution
    err = _caught("full", lambda: _run(_case(q), drawn))
    # VER-3 compares the two first (they differ); equal broken copies are VER-6's
    assert err is not None and err.invariant_id == "VER-3"
    err = _caught("full", lambda: _run(_case(drawn.clone()), drawn))
    assert err is not None and err.invariant_id == "VER-6" and err.observed["(request, draft slot)"] == [(0, 1)]
    garbage = _proposal()
    garbage[1, 1] = float("nan")  # request 1 has one draft: slot 1 is not drafted
    garbage[2] = -1.0  # request 2 has none
    assert _caught("full", lambda: _run(_case(garbage))) is None


def _pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Goodness of fit of the emitted ``tokens`` to ``p`` (every token of ``p`` has positive probability)."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() / p.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def _first_token_pvalue(mode: str, handed_scale: float) -> float:
    """p = (0.9, 0.1), drafts drawn from q = (0.5, 0.5), the proposal handed over is ``handed_scale * q``.

    Returns the chi-square p-value of the first emitted token against p.
    """
    g = torch.Generator().manual_seed(7)
    p = torch.tensor([0.9, 0.1])
    q = torch.tensor([0.5, 0.5])
    drafts = torch.multinomial(q, N_TRIALS, replacement=True, generator=g)[:, None]
    logits = p.log().repeat(2 * N_TRIALS, 1)  # draft row and bonus row per request
    handed = (q * handed_scale).expand(N_TRIALS, 1, 2).contiguous()
    inp = VerifierInput(drafts, torch.ones(N_TRIALS, dtype=torch.long), logits, handed)
    with contracts.enforce(mode):
        out = verify(
            inp,
            [PLAIN] * N_TRIALS,
            num_spec_tokens=1,
            num_draft_tokens=[1] * N_TRIALS,
            generator=g,
            sampled_from=handed,
        )
    return _pvalue(out.output_token_ids[:, 0], p)


def test_unnormalised_proposal_biases_sampling_unless_ver6_catches_it() -> None:
    """The issue's example: with the proposal (0.25, 0.25) token 1 came out at about 0.2 where p gives 0.1."""
    assert _first_token_pvalue("off", 1.0) > ALPHA  # the correct proposal: the test passes
    assert _first_token_pvalue("off", 0.5) < ALPHA  # halved, unchecked: the output distribution is off
    assert _first_token_pvalue("shapes", 0.5) < ALPHA  # VER-6 reads values: not in shapes mode
    with pytest.raises(ContractViolation) as info:
        _first_token_pvalue("full", 0.5)
    assert info.value.invariant_id == "VER-6"
    assert _first_token_pvalue("full", 1.0) > ALPHA  # and the correct one passes in full


def test_unchecked_broken_proposal_slots_are_not_used() -> None:
    """A NaN or negative proposal slot without VER-6: no crash, its draft is never accepted, the token follows p."""
    g = torch.Generator().manual_seed(8)
    p = torch.tensor([0.6, 0.3, 0.1])
    drafts = torch.multinomial(p, N_TRIALS, replacement=True, generator=g)[:, None]  # q = p: would always accept
    handed = p.expand(N_TRIALS, 1, 3).clone()
    handed[: N_TRIALS // 2, 0, 2] = float("nan")
    handed[N_TRIALS // 2 :, 0, 2] = -0.1
    logits = p.log().repeat(2 * N_TRIALS, 1)
    with contracts.enforce("off"):
        out = verify(
            VerifierInput(drafts, torch.ones(N_TRIALS, dtype=torch.long), logits, handed),
            [PLAIN] * N_TRIALS,
            num_spec_tokens=1,
            num_draft_tokens=[1] * N_TRIALS,
            generator=g,
            sampled_from=handed,
        )
    assert int(out.num_accepted.sum()) == 0
    assert _pvalue(out.output_token_ids[:, 0], p) > ALPHA


# -- VER-7: drafted tokens have positive proposal probability -------------------------------------------------------


def test_ver7_drafted_token_outside_the_proposal() -> None:
    q = _proposal()
    q[0, 1] = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])  # request 0's second draft (2) has no mass: top-k on one side
    assert _caught("shapes", lambda: _run(_case(q))) is None  # [D]
    err = _caught("full", lambda: _run(_case(q)))
    assert err is not None and err.invariant_id == "VER-7"
    assert err.observed["(request, draft slot)"] == [(0, 1)] and err.observed["draft token"] == 2
    q[2, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])  # request 2 drafts nothing: its slots are not checked
    q[0, 1] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    assert _caught("full", lambda: _run(_case(q))) is None


# -- sampling parameters and sample() -------------------------------------------------------------------------------


def test_temperature_bounds_name_the_limit() -> None:
    with pytest.raises(ValidationError, match=r"below 1\.17549435\d*e-38, the smallest accepted positive"):
        SamplingParams(temperature=1e-50)
    with pytest.raises(ValidationError, match="above"):
        SamplingParams(temperature=1e39)
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")], [5.0, 5.0, 1.0, 0.0]])
    for t in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        probs = probabilities(logits, SamplingParams(temperature=t))
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    coldest = probabilities(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    assert coldest[0].tolist() == [0.0, 1.0, 0.0, 0.0] and coldest[1, :2].tolist() == [0.5, 0.5]
    assert SamplingParams(temperature=0).greedy


def test_sample_names_rows_that_are_not_distributions() -> None:
    probs = torch.tensor([[0.5, 0.5], [float("nan"), 1.0], [0.0, 0.0], [-0.5, 1.5]])
    with pytest.raises(InvalidDistributionError, match=r"3 of 4 rows.*row 1: 1 NaN.*row 2: no mass.*row 3: negative"):
        sample(probs)
    assert sample(probs[:1], torch.Generator().manual_seed(0)).tolist() in ([0], [1])
