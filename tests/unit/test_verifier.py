"""Tests of the sampling transform and the lossless verifier.

Statistical tests use Pearson's chi-square (``scipy.stats.chisquare``) at
significance level ALPHA = 0.001 with fixed seeds, so each is deterministic: a
correct verifier passes (p-value > ALPHA), and the same test rejects
deliberately wrong verifiers (p-value < ALPHA), which shows it has power.
Trials are batched: N independent requests in one ``verify`` call stand for N
independent steps, since requests do not interact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from scipy.stats import chi2_contingency, chisquare

import contracts
from contracts import (
    REJECTED_TOKEN_ID,
    ContractViolation,
    StepKind,
    Subject,
    VerifierFacts,
    VerifierInput,
    VerifierOutput,
)
from specdec.sampling import SamplingParams, probabilities, sample
from specdec.verifier import verify

ALPHA = 1e-3
"""Significance level of every chi-square test in this module."""
N_TRIALS = 20_000
GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams()

Verifier = Callable[..., VerifierOutput]


# ---------------------------------------------------------------------------
# helpers


def _dist(seed: int, vocab: int, scale: float = 1.0) -> torch.Tensor:
    """A fixed, strictly positive distribution (float64) over ``vocab`` tokens."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g, dtype=torch.float64) * scale).softmax(-1)


def _row_positions(num_draft: torch.Tensor) -> torch.Tensor:
    """Position j (0 = first draft, d_r = bonus) of every request-major logits row."""
    counts = num_draft + 1
    first = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)


def _pad_drafts(drafts: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    k = drafts.shape[1]
    return torch.where(torch.arange(k)[None, :] < num_draft[:, None], drafts, REJECTED_TOKEN_ID)


def _chi2_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of ``samples`` (token ids) to ``expected``; zero-probability tokens must never occur."""
    counts = torch.bincount(samples.flatten(), minlength=expected.numel()).double().numpy()
    exp = expected.double().numpy()
    support = exp > 0
    assert counts[~support].sum() == 0, f"tokens of target probability 0 were emitted: {counts}"
    assert support.sum() >= 2
    exp_counts = exp[support] / exp[support].sum() * counts.sum()
    return float(chisquare(counts[support], exp_counts).pvalue)


def _check_well_formed(out: VerifierOutput, drafts: torch.Tensor, num_draft: Sequence[int]) -> None:
    for r, d in enumerate(num_draft):
        a = int(out.num_accepted[r])
        row = out.output_token_ids[r].tolist()
        assert 0 <= a <= d
        assert row[:a] == drafts[r, :a].tolist()
        assert row[a] >= 0
        assert all(t == REJECTED_TOKEN_ID for t in row[a + 1 :])


# ---------------------------------------------------------------------------
# sampling.py


def test_sampling_params_validation() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7, top_k=3, top_p=0.9).greedy
    for bad in (
        {"temperature": 1e-50},  # rounds to 0 in float32
        {"temperature": 1e39},  # inf in float32
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": -2},
        {"top_k": True},
        {"top_k": 2.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -1},
        {"seed": 2**63},
        {"seed": True},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop_token_ids": ["3"]},
        {"ignore_eos": 1},
        {"best_of": 2},  # a vLLM field specdec does not implement: refused, not ignored
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    assert SamplingParams(top_k=0).top_k is None and SamplingParams(top_k=-1).top_k is None  # vLLM's "all"
    with pytest.raises(ValidationError):
        PLAIN.temperature = 0.5


def _reference_probabilities(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Loop-based reference for one row, written independently of the vectorised code."""
    vocab = row.numel()
    if params.greedy:
        return torch.nn.functional.one_hot(row.argmax(), vocab).double()
    x = row.double() / params.temperature
    order = sorted(range(vocab), key=lambda i: (-x[i].item(), i))
    keep = set(order)
    if params.top_k is not None:
        kth = x[order[min(params.top_k, vocab) - 1]].item()
        keep = {i for i in keep if x[i].item() >= kth}
    if params.top_p is not None and params.top_p < 1.0:
        probs = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        probs[list(keep)] = x[list(keep)]
        probs = probs.softmax(-1)
        mass, nucleus = 0.0, set[int]()
        for i in order:
            if i in keep and (not nucleus or mass < params.top_p):
                nucleus.add(i)
                mass += probs[i].item()
        keep = nucleus
    out = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    out[list(keep)] = x[list(keep)]
    return out.softmax(-1)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.none() | st.integers(1, 12),
    top_p=st.none() | st.sampled_from([0.05, 0.3, 0.6, 0.9, 1.0]),
)


@settings(deadline=None, max_examples=60)
@given(rows=st.lists(params_strategy, min_size=1, max_size=5), vocab=st.integers(2, 10), seed=st.integers(0, 2**31 - 1))
def test_probabilities_matches_loop_reference(rows: list[SamplingParams], vocab: int, seed: int) -> None:
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    probs = probabilities(logits, rows)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)))
    for r, params in enumerate(rows):
        torch.testing.assert_close(probs[r].double(), _reference_probabilities(logits[r], params), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(probabilities(logits, rows[0]), probabilities(logits, [rows[0]] * len(rows)))


def test_probabilities_edge_cases() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [5.0, 5.0, 1.0, 0.0]])
    # greedy is one-hot argmax, the first index on exact ties (as torch.argmax and plain decoding)
    torch.testing.assert_close(probabilities(logits, GREEDY), torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))
    # top_k keeps ties at the k-th value; top_p keeps at least one token
    topk = probabilities(logits, SamplingParams(top_k=1))
    assert (topk[0] > 0).tolist() == [False, True, False, False]
    assert (topk[1] > 0).tolist() == [True, True, False, False]
    tiny_p = probabilities(logits, SamplingParams(top_p=1e-6))
    assert (tiny_p[0] > 0).sum() == 1
    # a tiny temperature does not overflow, low-precision logits come back as float32
    assert torch.isfinite(probabilities(logits * 1e4, SamplingParams(temperature=1e-6))).all()
    assert probabilities(logits.bfloat16(), PLAIN).dtype == torch.float32
    with pytest.raises(ValueError, match="one per row"):
        probabilities(logits, [PLAIN] * 3)


def test_sample_follows_probs() -> None:
    p = _dist(1, 6)
    draws = sample(p.float()[None].expand(N_TRIALS, -1), torch.Generator().manual_seed(2))
    assert _chi2_pvalue(draws, p) > ALPHA


# ---------------------------------------------------------------------------
# greedy verification


@st.composite
def greedy_batches(draw: st.DrawFn) -> dict[str, Any]:
    num_reqs = draw(st.integers(1, 6))
    k = draw(st.integers(1, 8))
    vocab = draw(st.integers(2, 10))
    num_draft = [draw(st.integers(0, k)) for _ in range(num_reqs)]
    prefix = [draw(st.integers(0, d)) for d in num_draft]
    sampled = [draw(st.booleans()) for _ in range(num_reqs)]
    return {
        "k": k,
        "vocab": vocab,
        "num_draft": num_draft,
        "prefix": prefix,
        "sampled": sampled,
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _greedy_case(
    k: int, vocab: int, num_draft: list[int], prefix: list[int], seed: int
) -> tuple[VerifierInput, torch.Tensor, list[list[int]]]:
    """Drafts that agree with the target argmax for ``prefix[r]`` positions, then disagree."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(num_draft)
    logits = torch.randn(sum(num_draft) + num_reqs, vocab, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.full((num_reqs, k), REJECTED_TOKEN_ID, dtype=torch.long)
    expected: list[list[int]] = []
    row = 0
    for r, (d, a) in enumerate(zip(num_draft, prefix, strict=True)):
        for j in range(d):
            target = int(argmax[row + j])
            if j < a:
                drafts[r, j] = target
            elif j == a:
                drafts[r, j] = (target + 1 + int(torch.randint(vocab - 1, (), generator=g))) % vocab
            else:
                drafts[r, j] = int(torch.randint(vocab, (), generator=g))
        expected.append([*drafts[r, :a].tolist(), int(argmax[row + a])] + [REJECTED_TOKEN_ID] * (k - a))
        row += d + 1
    inp = VerifierInput(drafts, torch.tensor(num_draft), logits)
    return inp, argmax, expected


@settings(deadline=None, max_examples=150)
@given(case=greedy_batches())
def test_greedy_equals_argmax_chain(case: dict[str, Any]) -> None:
    inp, _, expected = _greedy_case(case["k"], case["vocab"], case["num_draft"], case["prefix"], case["seed"])
    params = [PLAIN if s else GREEDY for s in case["sampled"]]
    with contracts.enforce("full"):
        out = verify(
            inp,
            params,
            num_spec_tokens=case["k"],
            num_draft_tokens=case["num_draft"],
            generator=torch.Generator().manual_seed(case["seed"]),
        )
    assert out.output_token_ids.shape == (len(params), case["k"] + 1)
    for r, is_sampled in enumerate(case["sampled"]):
        if not is_sampled:  # sampled requests in the same batch must not disturb greedy ones
            assert out.output_token_ids[r].tolist() == expected[r]
            assert int(out.num_accepted[r]) == case["prefix"][r]
    _check_well_formed(out, inp.draft_token_ids, case["num_draft"])


def test_greedy_all_accept_gives_bonus_and_full_reject_gives_first_argmax() -> None:
    k, vocab = 4, 7
    inp, argmax, _ = _greedy_case(k, vocab, [k, k], [k, 0], seed=3)
    out = verify(inp, [GREEDY, GREEDY], num_spec_tokens=k, num_draft_tokens=[k, k])
    assert out.num_accepted.tolist() == [k, 0]
    assert out.output_token_ids[0].tolist() == [*argmax[:k].tolist(), int(argmax[k])]  # bonus row
    assert out.output_token_ids[1].tolist() == [int(argmax[k + 1])] + [REJECTED_TOKEN_ID] * k


def test_speculative_greedy_decoding_equals_plain_greedy_decoding() -> None:
    """An engine loop (draft K, verify, append) emits exactly the plain greedy token stream."""
    vocab, k, length = 11, 4, 40
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(vocab, vocab, generator=g), torch.randn(vocab, vocab, generator=g)
    noise = torch.randn(vocab, vocab, generator=g) * 1.5

    def target(ctx: list[int]) -> torch.Tensor:
        return w1[ctx[-1]] + 0.7 * w2[ctx[-2]]

    def draft(ctx: list[int]) -> torch.Tensor:
        return target(ctx) + noise[ctx[-1]]

    prompts = [[1, 2], [3, 4], [5, 5]]
    plain = [list(p) for p in prompts]
    for ctx in plain:
        while len(ctx) < length:
            ctx.append(int(target(ctx).argmax()))

    spec = [list(p) for p in prompts]
    steps = 0
    while any(len(ctx) < length for ctx in spec):
        steps += 1
        num_draft = [min(k, max(0, length - len(ctx) - 1)) for ctx in spec]
        drafts = torch.full((len(spec), k), REJECTED_TOKEN_ID, dtype=torch.long)
        rows = []
        for r, ctx in enumerate(spec):
            ext = list(ctx)
            for j in range(num_draft[r]):
                drafts[r, j] = int(draft(ext).argmax())
                rows.append(target(ext))
                ext.append(int(drafts[r, j]))
            rows.append(target(ext))
        with contracts.enforce("full"):
            out = verify(
                VerifierInput(drafts, torch.tensor(num_draft), torch.stack(rows)),
                [GREEDY] * len(spec),
                num_spec_tokens=k,
                num_draft_tokens=num_draft,
            )
        for r, ctx in enumerate(spec):
            if len(ctx) < length:
                ctx.extend(out.output_token_ids[r, : int(out.num_accepted[r]) + 1].tolist())
    assert [ctx[:length] for ctx in spec] == plain
    assert steps < 3 * (length - 2)  # speculation did accept drafts


# ---------------------------------------------------------------------------
# lossless sampling: first emitted token


def _always_accept(
    inp: VerifierInput,
    params: Sequence[SamplingParams],
    *,
    num_spec_tokens: int,
    num_draft_tokens: Sequence[int],
    generator: torch.Generator | None = None,
    sampled_from: torch.Tensor | None = None,
) -> VerifierOutput:
    """WRONG on purpose: accepts every draft, then samples the bonus from p."""
    d = torch.tensor(list(num_draft_tokens))
    first = torch.cumsum(d + 1, 0) - (d + 1)
    bonus = sample(probabilities(inp.target_logits[first + d], list(params)), generator)
    pos = torch.arange(num_spec_tokens + 1)[None, :]
    padded = torch.cat([inp.draft_token_ids, torch.full((d.numel(), 1), REJECTED_TOKEN_ID)], 1)
    out = torch.where(pos < d[:, None], padded, torch.where(pos == d[:, None], bonus[:, None], REJECTED_TOKEN_ID))
    return VerifierOutput(out, d)


def _no_residual(
    inp: VerifierInput,
    params: Sequence[SamplingParams],
    *,
    num_spec_tokens: int,
    num_draft_tokens: Sequence[int],
    generator: torch.Generator | None = None,
    sampled_from: torch.Tensor | None = None,
) -> VerifierOutput:
    """WRONG on purpose: the usual min(1, p/q) test, but resamples from p instead of max(0, p − q)."""
    d = torch.tensor(list(num_draft_tokens))
    n, k = inp.draft_token_ids.shape
    first = torch.cumsum(d + 1, 0) - (d + 1)
    row_index = first[:, None] + torch.minimum(torch.arange(k + 1)[None, :], d[:, None])
    row_params = [p for p, c in zip(params, num_draft_tokens, strict=True) for _ in range(c + 1)]
    p = probabilities(inp.target_logits, row_params)[row_index]
    x = inp.draft_token_ids.clamp_min(0)
    assert inp.draft_probs is not None
    q_x = inp.draft_probs.gather(-1, x[..., None]).squeeze(-1)
    p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)
    u = torch.rand(n, k, generator=generator)
    ok = (torch.arange(k)[None, :] < d[:, None]) & (u * q_x < p_x)
    a = ok.long().cumprod(1).sum(1)
    token = sample(p[torch.arange(n), a], generator)
    pos = torch.arange(k + 1)[None, :]
    padded = torch.cat([inp.draft_token_ids, torch.full((n, 1), REJECTED_TOKEN_ID)], 1)
    out = torch.where(pos < a[:, None], padded, torch.where(pos == a[:, None], token[:, None], REJECTED_TOKEN_ID))
    return VerifierOutput(out, a)


VOCAB, K = 8, 3


def _first_token_trial(verifier: Verifier, *, probabilistic: bool, seed: int) -> tuple[float, torch.Tensor]:
    """N requests with d_r = r mod (K+1) drafts against fixed target rows p_j; returns (p-value, p_0).

    Probabilistic drafts are drawn from q_j and passed as draft_probs; otherwise
    request r's deterministic drafter proposes (r + j) mod V (one-hot q).
    """
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([_dist(10 + j, VOCAB) for j in range(K + 1)])
    q = torch.stack([_dist(20 + j, VOCAB, scale=1.5) for j in range(K)])
    num_draft = torch.arange(N_TRIALS) % (K + 1)
    logits = p.log().float()[_row_positions(num_draft)]
    if probabilistic:
        raw = torch.stack(
            [torch.multinomial(q[j].float(), N_TRIALS, replacement=True, generator=g) for j in range(K)], 1
        )
        draft_probs: torch.Tensor | None = q.float()[None].expand(N_TRIALS, K, VOCAB)
    else:
        raw = (torch.arange(N_TRIALS)[:, None] + torch.arange(K)[None, :]) % VOCAB
        draft_probs = None
    drafts = _pad_drafts(raw, num_draft)
    inp = VerifierInput(drafts, num_draft, logits, draft_probs)
    with contracts.enforce("full"):
        out = verifier(
            inp,
            [PLAIN] * N_TRIALS,
            num_spec_tokens=K,
            num_draft_tokens=num_draft.tolist(),
            generator=g,
            sampled_from=draft_probs,
        )
    return _chi2_pvalue(out.output_token_ids[:, 0], p[0]), out.num_accepted


def test_lossless_first_token_probabilistic_drafts() -> None:
    pvalue, num_accepted = _first_token_trial(verify, probabilistic=True, seed=100)
    assert pvalue > ALPHA
    assert 0 < num_accepted.float().mean() < K  # some drafts accepted, some rejected


def test_lossless_first_token_argmax_drafts() -> None:
    pvalue, num_accepted = _first_token_trial(verify, probabilistic=False, seed=101)
    assert pvalue > ALPHA
    assert num_accepted.sum() > 0


@pytest.mark.parametrize("wrong", [_always_accept, _no_residual], ids=["always-accept", "no-residual"])
def test_chi_square_rejects_wrong_verifiers(wrong: Verifier) -> None:
    """The same trial and threshold fail for a biased verifier: the lossless tests have power."""
    pvalue, _ = _first_token_trial(wrong, probabilistic=True, seed=100)
    assert pvalue < ALPHA


def test_lossless_with_temperature_top_k_top_p() -> None:
    """Two parameter sets in one batch; the reference is probabilities(target_logits, params)."""
    vocab, k = 8, 2
    g = torch.Generator().manual_seed(5)
    groups = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9), SamplingParams(temperature=1.7, top_k=5)]
    target = torch.randn(k + 1, vocab, generator=g) * 2
    draft = torch.randn(k, vocab, generator=g) * 2
    num_draft = torch.full((N_TRIALS,), k)
    params = [groups[r % 2] for r in range(N_TRIALS)]
    q = torch.stack([probabilities(draft, grp) for grp in groups])  # (group, k, vocab), the drafter's transform
    group = torch.arange(N_TRIALS) % 2
    draft_probs = q[group]
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(N_TRIALS, k)
    logits = target[_row_positions(num_draft)]
    with contracts.enforce("full"):
        out = verify(
            VerifierInput(drafts, num_draft, logits, draft_probs),
            params,
            num_spec_tokens=k,
            num_draft_tokens=num_draft.tolist(),
            generator=g,
            sampled_from=draft_probs,
        )
    for i, grp in enumerate(groups):
        reference = probabilities(target[:1], grp)[0]
        assert (reference == 0).sum() >= 2  # top-k/top-p really cut tokens
        assert _chi2_pvalue(out.output_token_ids[group == i, 0], reference) > ALPHA


# ---------------------------------------------------------------------------
# lossless sampling: joint distribution of the first two emitted tokens


def test_lossless_joint_first_two_tokens_with_conditioned_target_rows() -> None:
    """K=2: target row 1 is p2(· | draft token 0), as an engine computes it.

    A step that rejects the first draft emits one token; like an engine, the next
    step then drafts from that token and verifies again. The pairs must follow
    p1(a)·p2(b | a), checked against the exact joint and against pairs sampled
    directly from the target chain.
    """
    vocab, n = 6, N_TRIALS
    g = torch.Generator().manual_seed(11)
    p1 = _dist(30, vocab, 0.6)
    p2 = torch.stack([_dist(40 + a, vocab, 0.6) for a in range(vocab)])  # p2[a] = target(· | a)
    p3 = torch.stack([_dist(60 + b, vocab, 0.6) for b in range(vocab)])  # bonus row, target(· | a, b)
    q1 = _dist(50, vocab, 1.2)
    q2 = torch.stack([_dist(70 + a, vocab, 1.2) for a in range(vocab)])  # draft model(· | a)

    x1 = torch.multinomial(q1.float(), n, replacement=True, generator=g)
    x2 = torch.multinomial(q2.float()[x1], 1, generator=g).squeeze(1)
    draft_probs = torch.stack([q1.float().expand(n, vocab), q2.float()[x1]], 1)
    logits = torch.stack([p1.expand(n, vocab), p2[x1], p3[x2]], 1).reshape(3 * n, vocab).log().float()
    with contracts.enforce("full"):
        out = verify(
            VerifierInput(torch.stack([x1, x2], 1), torch.full((n,), 2), logits, draft_probs),
            [PLAIN] * n,
            num_spec_tokens=2,
            num_draft_tokens=[2] * n,
            generator=g,
            sampled_from=draft_probs,
        )
    first, second = out.output_token_ids[:, 0], out.output_token_ids[:, 1].clone()
    again = (out.num_accepted == 0).nonzero().squeeze(1)
    assert 0 < again.numel() < n
    # next step for the requests that emitted one token: draft from q2(· | first), verify against p2(· | first)
    y = first[again]
    m = again.numel()
    x = torch.multinomial(q2.float()[y], 1, generator=g)
    next_probs = q2.float()[y][:, None]
    next_logits = torch.stack([p2[y], p3[x[:, 0]]], 1).reshape(2 * m, vocab).log().float()
    with contracts.enforce("full"):
        out2 = verify(
            VerifierInput(x, torch.ones(m, dtype=torch.long), next_logits, next_probs),
            [PLAIN] * m,
            num_spec_tokens=1,
            num_draft_tokens=[1] * m,
            generator=g,
            sampled_from=next_probs,
        )
    second[again] = out2.output_token_ids[:, 0]

    pairs = first * vocab + second
    joint = (p1[:, None] * p2).flatten()
    assert _chi2_pvalue(pairs, joint) > ALPHA

    a = torch.multinomial(p1.float(), n, replacement=True, generator=g)
    b = torch.multinomial(p2.float()[a], 1, generator=g).squeeze(1)
    direct = torch.bincount(a * vocab + b, minlength=vocab * vocab)
    spec = torch.bincount(pairs, minlength=vocab * vocab)
    assert chi2_contingency(np.stack([spec.numpy(), direct.numpy()])).pvalue > ALPHA


# ---------------------------------------------------------------------------
# contracts triggered on purpose


def _small_input(probs: bool = False) -> tuple[VerifierInput, list[int]]:
    g = torch.Generator().manual_seed(0)
    num_draft = [2, 1]
    draft_probs = torch.full((2, 2, 5), 0.2) if probs else None
    inp = VerifierInput(
        torch.tensor([[1, 2], [3, -1]]), torch.tensor(num_draft), torch.randn(5, 5, generator=g), draft_probs
    )
    return inp, num_draft


def _violation(fn: Callable[[], object]) -> str:
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        fn()
    return info.value.invariant_id


def test_tgt6_logits_with_an_extra_row() -> None:
    inp, num_draft = _small_input()
    extra = VerifierInput(inp.draft_token_ids, inp.num_draft_tokens, torch.randn(6, 5))
    assert _violation(lambda: verify(extra, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=num_draft)) == "TGT-6"
    too_many = VerifierInput(inp.draft_token_ids, inp.num_draft_tokens, torch.randn(6, 5))
    assert _violation(lambda: verify(too_many, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=[3, 1])) == "TGT-6"
    with contracts.enforce("off"), pytest.raises(ValueError, match="TGT-6"):  # still refused with contracts off
        verify(extra, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=num_draft)


def test_ver3_proposal_not_the_one_drawn_from() -> None:
    inp, num_draft = _small_input(probs=True)
    assert inp.draft_probs is not None
    same_values = inp.draft_probs.clone()
    other = torch.softmax(torch.randn(inp.draft_probs.shape, generator=torch.Generator().manual_seed(3)), -1)

    def run(sampled_from: torch.Tensor | None) -> VerifierOutput:
        return verify(inp, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=num_draft, sampled_from=sampled_from)

    assert _violation(lambda: run(None)) == "VER-3"  # [S] one present, the other not
    assert _violation(lambda: run(other[:, :1])) == "VER-3"  # [S] shapes differ
    with contracts.enforce("shapes"):
        run(other)  # [D]: shapes mode reads no values
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        run(other)
    assert info.value.invariant_id == "VER-3" and "max |given - drawn|" in info.value.observed
    with contracts.enforce("full"):
        run(inp.draft_probs)  # the same object passes
        run(same_values)  # and so does an equal copy


def test_ver7_draft_with_zero_proposal_probability_is_not_accepted() -> None:
    inp, num_draft = _small_input(probs=True)
    q = torch.full((2, 2, 5), 0.2)
    q[0, 0, 1], q[0, 0, 0] = 0.0, 0.4  # draft token 1 of request 0 could not have been drawn from q
    bad = VerifierInput(inp.draft_token_ids, inp.num_draft_tokens, inp.target_logits, q)
    call = lambda: verify(bad, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=num_draft, sampled_from=q)  # noqa: E731
    assert _violation(call) == "VER-7"
    with contracts.enforce("off"):  # unchecked, it is rejected rather than silently accepted
        assert int(call().num_accepted[0]) == 0


@pytest.mark.parametrize("fault", [float("nan"), float("inf"), -0.1])
def test_a_proposal_that_is_not_a_distribution_is_never_accepted(fault: float) -> None:
    inp, num_draft = _small_input(probs=True)
    logits = torch.full((5, 5), -30.0)
    logits[0, 1] = logits[1, 2] = logits[3, 3] = 30.0  # the target all but certain of every draft
    q = torch.full((2, 2, 5), 0.2)
    q[0, 0, 4] = fault  # request 0's first slot, at a token other than its draft
    bad = VerifierInput(inp.draft_token_ids, inp.num_draft_tokens, logits, q)
    with contracts.enforce("off"):
        out = verify(bad, [PLAIN] * 2, num_spec_tokens=2, num_draft_tokens=num_draft, sampled_from=q)
    # The broken slot is treated as no draft: nothing of request 0 accepted, its token drawn from p; request 1 as usual.
    assert out.num_accepted.tolist() == [0, 1] and out.output_token_ids[0, 0] == 1


def test_ver1_malformed_outputs() -> None:
    inp, num_draft = _small_input()

    def check(out: VerifierOutput) -> None:
        facts = VerifierFacts(2, 2, num_draft, inp, out)
        contracts.check(Subject.VERIFIER, facts, step_kind=StepKind.VERIFY, component="test")

    wrong_shape = VerifierOutput(torch.tensor([[1, 2], [3, -1]]), torch.tensor([1, 0]))
    not_sentinel = VerifierOutput(torch.tensor([[4, -1, 0], [3, -1, -1]]), torch.tensor([0, 0]))
    bonus_outside_vocab = VerifierOutput(torch.tensor([[1, 9, -1], [3, -1, -1]]), torch.tensor([1, 0]))
    for out in (wrong_shape, not_sentinel, bonus_outside_vocab):
        assert _violation(lambda out=out: check(out)) == "VER-1"  # type: ignore[misc]
    # More accepted than drafted is VER-2's (a padded slot accepted), not a dropped bonus.
    too_many = VerifierOutput(torch.tensor([[1, 2, 3], [3, 4, -1]]), torch.tensor([2, 2]))
    assert _violation(lambda: check(too_many)) == "VER-2"
    with contracts.enforce("full"):
        check(VerifierOutput(torch.tensor([[1, 0, -1], [3, 4, -1]]), torch.tensor([1, 1])))


def test_ver2_pad_draft_accepted() -> None:
    small, _ = _small_input()
    # the scheduler says request 1 has 2 drafts, but its second slot is a pad
    inp = VerifierInput(small.draft_token_ids, torch.tensor([2, 2]), torch.randn(6, 5))
    facts = VerifierFacts(
        2, 2, [2, 2], inp, VerifierOutput(torch.tensor([[1, 0, -1], [3, 4, 0]]), torch.tensor([1, 2]))
    )
    check = lambda: contracts.check(Subject.VERIFIER, facts, step_kind=StepKind.VERIFY, component="test")  # noqa: E731
    assert _violation(check) == "VER-2"


@pytest.mark.parametrize("params", [GREEDY, PLAIN], ids=["greedy", "sampled"])
def test_verifier_never_accepts_a_pad_inside_num_draft(params: SamplingParams) -> None:
    """A pad where a draft should be stops acceptance there; the token at that slot comes from p."""
    vocab = 5
    logits = torch.full((3, vocab), -30.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = 30.0  # the target is certain: 2, then 4
    inp = VerifierInput(torch.tensor([[2, REJECTED_TOKEN_ID]]), torch.tensor([2]), logits)
    with contracts.enforce("full"):
        out = verify(inp, [params], num_spec_tokens=2, num_draft_tokens=[2], generator=torch.Generator().manual_seed(0))
    assert out.num_accepted.tolist() == [1]
    assert out.output_token_ids.tolist() == [[2, 4, REJECTED_TOKEN_ID]]


def test_verify_checks_its_arguments() -> None:
    inp, num_draft = _small_input()
    with pytest.raises(ValueError, match="one per request"):
        verify(inp, [PLAIN], num_spec_tokens=2, num_draft_tokens=num_draft)
    # with contracts on, VER-4 names the wrong shape first; with them off the host check still refuses it
    assert _violation(lambda: verify(inp, [PLAIN] * 2, num_spec_tokens=3, num_draft_tokens=num_draft)) == "VER-4"
    with contracts.enforce("off"), pytest.raises(ValueError, match="draft_token_ids"):
        verify(inp, [PLAIN] * 2, num_spec_tokens=3, num_draft_tokens=num_draft)
