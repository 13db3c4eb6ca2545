"""Free drafts checked against the output count as verification would have counted them, greedy and sampled."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import VerifierInput
from specdec.draft_length import AcceptanceRates, DraftLengthPolicy
from specdec.sampling import SamplingParams
from specdec.shadow_drafts import FreeDraft, ShadowDrafts, ShadowOutcome
from specdec.step_cost import StepCost
from specdec.verifier import verify

NEVER_PAYS = StepCost(base=0.02, per_row=0.05, per_proposal=0.05, per_draft=0.05)
"""A verify row costs 2.5 plain steps: no draft is ever worth it."""


def test_a_draft_settles_at_its_first_mismatch_or_when_all_matched() -> None:
    shadows = ShadowDrafts()
    prompt = [7, 8, 9]
    shadows.start("a", "lookup", FreeDraft(3, (1, 2, 3)))
    assert shadows.observe("a", prompt) is None and "a" in shadows  # nothing emitted yet
    assert shadows.observe("a", [*prompt, 1]) is None  # one matched, two to go
    assert shadows.observe("a", [*prompt, 1, 5]) == ShadowOutcome("lookup", 3, 1)
    assert "a" not in shadows and shadows.observe("a", [*prompt, 1, 5, 3]) is None
    shadows.start("b", "lookup", FreeDraft(2, (4, 4)))
    assert shadows.observe("b", [0, 0, 4, 4, 9]) == ShadowOutcome("lookup", 2, 2)  # a step that emitted three


def test_one_draft_at_a_time_and_positions_compared_again_after_an_undone_step() -> None:
    shadows = ShadowDrafts()
    shadows.start("a", "lookup", FreeDraft(1, (5, 6, 7)))
    shadows.start("a", "lookup", FreeDraft(2, (6, 6, 6)))  # pending: ignored, not counted twice
    assert shadows.observe("a", [0, 5, 6]) is None
    # The step that emitted 6 is undone and run again: the same positions are compared, nothing shifts.
    assert shadows.observe("a", [0, 5]) is None
    assert shadows.observe("a", [0, 5, 6]) is None
    assert shadows.observe("a", [0, 5, 6, 7]) == ShadowOutcome("lookup", 3, 3)


def test_a_request_that_ends_counts_only_the_positions_its_output_reached() -> None:
    shadows = ShadowDrafts()
    shadows.start("a", "lookup", FreeDraft(1, (5, 6, 7)))
    shadows.start("b", "lookup", FreeDraft(1, (5, 6)))
    assert shadows.observe("a", [0, 5, 6]) is None and shadows.observe("b", [0]) is None
    assert shadows.drop("a") == ShadowOutcome("lookup", 2, 2)
    assert shadows.drop("b") is None and shadows.drop("c") is None


@pytest.mark.parametrize("position, tokens", [(0, (1,)), (3, ())])
def test_a_free_draft_needs_a_position_and_tokens(position: int, tokens: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="a free draft needs"):
        FreeDraft(position, tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.data())
def test_greedy_outcomes_are_the_verifiers(draft: list[int], data: st.DataObject) -> None:
    """Target argmaxes that follow the draft for a while: the shadow's count is the greedy verifier's."""
    vocab, n = 6, len(draft)
    argmax = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n + 1, max_size=n + 1))
    agree = data.draw(st.integers(0, n))
    argmax[:agree] = draft[:agree]  # the target agrees with the first drafts, as a match often does
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float() * 5.0
    inp = VerifierInput(torch.tensor([draft]), torch.tensor([n]), logits, None)
    verified = verify(inp, [SamplingParams(temperature=0.0)], num_spec_tokens=n, num_draft_tokens=[n])
    shadows = ShadowDrafts()
    shadows.start("r", "lookup", FreeDraft(1, tuple(draft)))
    outcome = shadows.observe("r", [9, *argmax])  # plain decoding emits the argmaxes one by one
    assert outcome == ShadowOutcome("lookup", n, int(verified.num_accepted[0]))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.9)],
    ids=["T=1", "T=0.7,top_k,top_p"],
)
def test_sampled_outcomes_have_the_verifiers_distribution(params: SamplingParams) -> None:
    """A one-hot draft token verified, against the same token sampled by a plain step, both by the engine's
    verifier: accepted as often (two-proportion z-test, significance 0.001, 4,000 draws each, fixed seeds)."""
    draws, draft = 4000, 1
    row = torch.tensor([1.2, 0.9, 0.3, -0.5, 0.1])
    generator = torch.Generator().manual_seed(11)
    verified = verify(
        VerifierInput(
            torch.full((draws, 1), draft), torch.ones(draws, dtype=torch.int64), row.repeat(2 * draws, 1), None
        ),
        [params] * draws,
        num_spec_tokens=1,
        num_draft_tokens=[1] * draws,
        generator=generator,
    )
    plain = verify(
        VerifierInput(
            torch.zeros((draws, 0), dtype=torch.int64),
            torch.zeros(draws, dtype=torch.int64),
            row.repeat(draws, 1),
            None,
        ),
        [params] * draws,
        num_spec_tokens=0,
        num_draft_tokens=[0] * draws,
        generator=torch.Generator().manual_seed(12),
    )
    accepted = 0
    for emitted in plain.output_token_ids[:, 0].tolist():
        shadows = ShadowDrafts()
        shadows.start("r", "lookup", FreeDraft(1, (draft,)))
        outcome = shadows.observe("r", [0, emitted])
        assert outcome is not None
        accepted += outcome.num_accepted
    p1, p2 = verified.num_accepted.float().mean().item(), accepted / draws
    pooled = (p1 + p2) / 2
    z = (p1 - p2) / math.sqrt(2 * pooled * (1 - pooled) / draws)
    assert 0.1 < p1 < 0.9 and abs(z) < 3.29, (p1, p2, z)


def test_a_request_left_at_zero_drafts_learns_its_lookup_rates_from_its_output() -> None:
    """Drafting never pays; a request copies its history. Its free drafts, checked against what it emits, move the
    lookup's rates from the prior."""
    policy = DraftLengthPolicy(4, cost=NEVER_PAYS)
    policy._by_source["lookup"] = AcceptanceRates(4, pool_decay=1.0)
    tokens = [3, 1, 2]
    for step in range(24):
        # Wrong at its first token every third decision, else what the target then emits.
        right = tuple((1, 2, 3)[(len(tokens) + j) % 3] for j in range(4))
        draft = (5, 5, 5, 5) if step % 3 == 0 else right
        lengths = policy.choose(
            ["r"],
            base_rows=1,
            sources={"r": "lookup"},
            limits={"lookup": 4},
            free_drafts={"r": FreeDraft(len(tokens), draft)},
        )
        assert lengths == {"r": 0}  # not even a probe: priced, one waits ~200 decisions here
        tokens.append((1, 2, 3)[len(tokens) % 3])  # the target keeps copying 1 2 3
        policy.record_output("r", tokens)
    rates = policy.acceptance_of("lookup")
    trials, accepted = rates._pool.trials, rates._pool.accepted
    # A wrong draft settles at once, a right one after 4 tokens (one a step), and none starts while one is
    # pending: wrong ones start at decisions 0, 9 and 18, right ones at 1, 5, 10, 14 and 19 (and 23, pending).
    assert policy.shadow_outcomes == trials[0] == 8 and "r" in policy.shadows
    assert accepted == [5.0, 5.0, 5.0, 5.0] and trials == [8.0, 5.0, 5.0, 5.0]
    assert rates.own_trials("r") == 8
    assert policy.acceptance._pool.trials == [0.0] * 4  # the model's rates learned nothing: it drafted nothing


def test_drafting_requests_and_requests_without_free_drafts_start_none() -> None:
    drafts_pay = StepCost(base=0.02, per_row=0.0001, per_proposal=0.0, per_draft=0.0)
    policy = DraftLengthPolicy(4, cost=drafts_pay)
    free = {"a": FreeDraft(3, (1, 2))}
    assert policy.choose(["a", "b"], base_rows=2, free_drafts=free) == {"a": 4, "b": 4}
    assert "a" not in policy.shadows and "b" not in policy.shadows
    idle = DraftLengthPolicy(4, cost=NEVER_PAYS)
    idle.choose(["a", "b"], base_rows=2, remaining={"a": 1, "b": 9}, free_drafts=free)
    assert "a" in idle.shadows and "b" not in idle.shadows
    idle.record_output("a", [0, 0, 0, 1, 2])  # cut to the one token "a" may still emit: settled by the first
    assert idle.acceptance._pool.trials == [1.0, 0.0, 0.0, 0.0] and idle.acceptance._pool.accepted[0] == 1.0


def test_a_forgotten_request_counts_what_its_output_matched() -> None:
    policy = DraftLengthPolicy(4, cost=NEVER_PAYS)
    policy.choose(["a"], base_rows=1, sources={"a": "lookup"}, free_drafts={"a": FreeDraft(2, (1, 2, 3))})
    policy.record_output("a", [0, 0, 1, 2])
    policy.forget("a")
    assert policy.acceptance_of("lookup")._pool.trials[:3] == [1.0, 1.0, 0.0]
    assert policy.shadow_outcomes == 1 and "a" not in policy.shadows
