"""Prompt lookup first (``-O lookup=N``): lossless, checked, and the wrapped drafter never drafts a lookup's row."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import backends.lookup_first as lookup_first
from backends import create
from backends.lookup_first import LookupFirst
from contracts import ContractViolation, enforce
from specdec.draft_length import AcceptanceRates, DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.shadow_drafts import FreeDraft
from specdec.speculator import DraftContext, Proposal, TargetStep
from specdec.step_cost import StepCost

CONFIG = EngineConfig(num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96))
ADAPTIVE = EngineConfig(
    num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96), draft_length="adaptive"
)
# A repeated phrase (lookups from the start), a short prompt, and one that repeats nothing at first.
PROMPTS = [(3, 17, 40, 3, 17, 40, 3, 17), (5, 9), (11, 12, 13, 14, 15)]
DRAFTS_PAY = StepCost(base=0.02, per_row=0.0005, per_proposal=0.001, per_draft=0.0005)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(), seed=0)


def run(engine: Engine, params: SamplingParams | None = None) -> list[list[int]]:
    reqs = [
        engine.add_request(f"q{i}", p, max_tokens=40, params=params or SamplingParams(temperature=0.0), seed=7 + i)
        for i, p in enumerate(PROMPTS)
    ]
    while engine.has_work:
        engine.step()
    return [list(r.output) for r in reqs]


class Spy:
    """What the wrapped drafter was asked and what it answered, per proposal that a lookup merged into."""

    def __init__(self, spec: LookupFirst, monkeypatch: pytest.MonkeyPatch, *, separate: bool = False) -> None:
        """``separate``: the wrapped drafter reports ``sampled_from`` as its own tensor, not ``draft_probs``."""
        self.merged: list[tuple[TargetStep, TargetStep, Proposal, dict[int, list[int]]]] = []
        self.inner_drafted = 0
        outer_propose, inner_propose = spec.propose, spec.inner.propose
        outer: list[TargetStep] = []
        inner: list[TargetStep] = []

        def propose_outer(step: TargetStep, ctx: DraftContext) -> Proposal:
            outer[:] = [step]
            return outer_propose(step, ctx)

        def propose_inner(step: TargetStep, ctx: DraftContext) -> Proposal:
            inner[:] = [step]
            proposal = inner_propose(step, ctx)
            self.inner_drafted += sum(proposal.num_drafts)
            if separate and proposal.sampled_from is not None:
                proposal = dataclasses.replace(proposal, sampled_from=proposal.sampled_from.clone())
            return proposal

        real = lookup_first.with_drafts

        def with_drafts(proposal: Proposal, drafts: dict[int, list[int]]) -> Proposal:
            self.merged.append((outer[0], inner[0], proposal, {r: list(d) for r, d in drafts.items()}))
            return real(proposal, drafts)

        monkeypatch.setattr(spec, "propose", propose_outer)
        monkeypatch.setattr(spec.inner, "propose", propose_inner)
        monkeypatch.setattr(lookup_first, "with_drafts", with_drafts)


MAKERS: dict[str, Callable[[Transformer], LookupFirst]] = {
    name: (lambda t, name=name: create(name, t, num_spec_tokens=3, lookup=2))  # type: ignore[misc]
    for name in ("eagle", "dflash", "dspark", "draft-model")
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("backend", sorted(MAKERS))
def test_greedy_output_equals_plain_with_both_sources_drafting(
    target: Transformer, backend: str, adaptive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = run(Engine(target, CONFIG))
    spec = MAKERS[backend](target)
    assert isinstance(spec, LookupFirst) and spec.name == backend
    spy = Spy(spec, monkeypatch)
    policy = DraftLengthPolicy(3, cost=DRAFTS_PAY) if adaptive else None
    with enforce("full"):
        engine = Engine(target, ADAPTIVE if adaptive else CONFIG, speculator=spec, draft_policy=policy)
        assert run(engine) == plain
    assert spec.looked_up > 0 and spy.inner_drafted > 0  # both sources drafted
    for outer, step, inner, drafts in spy.merged:
        for r, tokens in drafts.items():
            assert not step.drafting[r] and inner.num_drafts[r] == 0  # the wrapped drafter left the row alone
            assert 0 < len(tokens) <= outer.draft_budget(r, 3)


def test_a_lookup_never_drafts_past_the_budget(target: Transformer) -> None:
    """Under budgets of 1 (probes: no draft pays here), every lookup row drafts at most 1."""
    spec = create("eagle", target, num_spec_tokens=3, lookup=1)
    assert isinstance(spec, LookupFirst)
    # A verify row costs more than a token is worth, so no draft pays, not even a lookup's, which costs rows only.
    cheap_one = StepCost(base=0.02, per_row=0.05, per_proposal=0.001, per_draft=0.05)
    with enforce("full"):
        # Probes at probe_every whatever they cost (probe_share 1): they are what drafts here.
        policy = DraftLengthPolicy(3, cost=cheap_one, probe_share=1.0)
        engine = Engine(target, ADAPTIVE, speculator=spec, draft_policy=policy)
        assert run(engine) == run(Engine(target, CONFIG))
    assert spec.looked_up > 0
    assert engine.metrics.drafted > 0 and not any(engine.metrics.drafted_by_position[1:])


@pytest.mark.parametrize(
    ("backend", "separate"), [("eagle", False), ("dspark", False), ("eagle", True)], ids=["eagle", "dspark", "separate"]
)
def test_sampled_proposals_hand_one_hot_rows_for_lookups(
    target: Transformer, backend: str, separate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafters that hand the verifier distributions: the lookup's rows become one-hot, checked in ``full`` (VER-3
    compares ``sampled_from`` with ``draft_probs`` where a drafter reports both)."""
    spec = create(backend, target, num_spec_tokens=3, lookup=1)  # single-token matches: frequent when sampling
    assert isinstance(spec, LookupFirst)
    spy = Spy(spec, monkeypatch, separate=separate)
    with enforce("full"):
        run(Engine(target, CONFIG, speculator=spec), SamplingParams(temperature=0.7))
    checked = [(p, d) for _, _, p, d in spy.merged if p.draft_probs is not None]
    assert checked, "no merged proposal carried distributions"
    for proposal, drafts in checked:
        for r, tokens in drafts.items():
            for probs in (proposal.draft_probs, proposal.sampled_from):
                assert probs is not None
                for j, token in enumerate(tokens):
                    assert float(probs[r, j, token]) == 1.0 and float(probs[r, j].sum()) == 1.0
                assert float(probs[r, len(tokens) :].abs().sum()) == 0.0


@pytest.mark.parametrize("bad", [-1, True])  # other types fail the factory's type check first under pytest
def test_a_lookup_that_is_not_a_count_is_refused(target: Transformer, bad: object) -> None:
    with pytest.raises(ValueError, match="shortest suffix match in tokens, an integer >= 0"):
        create("dflash", target, lookup=bad)


class RecordingPolicy(DraftLengthPolicy):
    """The adaptive policy, keeping the sources each decision was told."""

    def __init__(self) -> None:
        super().__init__(3, cost=DRAFTS_PAY)
        self.told: list[dict[str, str]] = []

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: Any) -> dict[str, int]:
        self.told.append(dict(context.get("sources") or {}))
        return super().choose(req_ids, base_rows=base_rows, **context)


def test_the_policy_is_told_which_requests_the_lookup_drafts(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decision names the source every request's drafts then come from, and the lookup's are counted apart."""
    spec = create("dflash", target, num_spec_tokens=3, lookup=2)
    assert isinstance(spec, LookupFirst)
    policy = RecordingPolicy()
    outer_propose = spec.propose
    pairs: list[tuple[dict[str, str], TargetStep, set[str]]] = []

    def propose(step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = outer_propose(step, ctx)
        # The rows the lookup drafted: those whose index (now holding the step's history) has a match.
        looked = {
            s.req_id
            for r, s in enumerate(step.scheduled)
            if step.draft_budget(r, 3) and spec._indexes[s.req_id].drafts(step.next_token_ids[r], 1)
        }
        pairs.append((policy.told[-1] if policy.told else {}, step, looked))
        return proposal

    monkeypatch.setattr(spec, "propose", propose)
    with enforce("full"):
        engine = Engine(target, ADAPTIVE, speculator=spec, draft_policy=policy)
        assert run(engine) == run(Engine(target, CONFIG))
    told_lookup = 0
    for told, step, looked in pairs:
        for r, s in enumerate(step.scheduled):
            if step.draft_budget(r, 3):
                assert (told[s.req_id] == "lookup") == (s.req_id in looked)
                told_lookup += told[s.req_id] == "lookup"
    assert told_lookup > 0
    lookup_trials = policy.acceptance_of("lookup")._pool.trials[0]
    assert lookup_trials > 0 and policy.acceptance._pool.trials[0] > 0


PAST_K: dict[str, Callable[[Transformer], LookupFirst]] = {
    name: (lambda t, name=name: create(name, t, num_spec_tokens=3, lookup=2, lookup_drafts=6))  # type: ignore[misc]
    for name in ("eagle", "dflash", "dspark")
}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("backend", sorted(PAST_K))
def test_lookups_draft_past_the_models_k_and_the_output_equals_plain(
    target: Transformer, backend: str, adaptive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lookup_drafts=6`` before a drafter of K = 3: the engine verifies up to 6 drafts of a match, the drafter is
    asked for 3 at most and its proposal is checked at 3 (``full``), and greedy output is plain decoding's."""
    plain = run(Engine(target, CONFIG))
    spec = PAST_K[backend](target)
    assert spec.num_spec_tokens == 6 and spec.draft_limits == {"lookup": 6, "model": 3}
    spy = Spy(spec, monkeypatch)
    asked: list[int] = []
    inner_propose = spec.inner.propose

    def propose(step: TargetStep, ctx: DraftContext) -> Proposal:
        asked.extend(step.draft_budget(r, 6) for r in range(step.num_reqs))
        proposal = inner_propose(step, ctx)
        assert proposal.draft_token_ids.shape[1] == 3 and max(proposal.num_drafts) <= 3
        return proposal

    monkeypatch.setattr(spec.inner, "propose", propose)
    policy = DraftLengthPolicy(6, cost=DRAFTS_PAY) if adaptive else None
    with enforce("full"):
        engine = Engine(target, ADAPTIVE if adaptive else CONFIG, speculator=spec, draft_policy=policy)
        assert run(engine) == plain
    assert max(asked) <= 3 and (adaptive or max(asked) == 3)  # the wrapped drafter is never asked past its K
    longest = max(len(d) for _, _, _, drafts in spy.merged for d in drafts.values())
    assert longest > 3  # a match drafted past the model's K
    assert engine.metrics.drafted_by_position[3] > 0 and sum(engine.metrics.drafted_by_position[6:]) == 0


def test_the_wrapped_drafters_proposal_is_checked_at_its_own_k(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Widening drops the block evidence, so the wrapper checks it first: a drafter sampling one block row too many
    is caught (BLK-7) whether or not the lookup drafts past its K."""
    for lookup_drafts in (0, 6):
        spec = create("dflash", target, num_spec_tokens=3, lookup=2, lookup_drafts=lookup_drafts)
        assert isinstance(spec, LookupFirst)
        inner_propose = spec.inner.propose

        def propose(step: TargetStep, ctx: DraftContext, inner_propose: Any = inner_propose) -> Proposal:
            proposal = inner_propose(step, ctx)
            ev = proposal.evidence
            if ev is None or not ev.num_drafting:
                return proposal
            extra = ev.sample_indices[:1]
            bad = dataclasses.replace(ev, sample_indices=torch.cat([ev.sample_indices, extra]))
            return dataclasses.replace(proposal, evidence=bad)

        monkeypatch.setattr(spec.inner, "propose", propose)
        with enforce("shapes"), pytest.raises(ContractViolation) as caught:
            run(Engine(target, CONFIG, speculator=spec))
        assert caught.value.invariant_id == "BLK-7"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lookup": 2, "lookup_drafts": 2}, r"lookup_drafts \(2\) must be 0 or at least the drafter's K \(3\)"),
        ({"lookup": 2, "lookup_drafts": -1}, "an integer >= 0"),
        ({"lookup": 2, "lookup_drafts": True}, "an integer >= 0"),
        ({"lookup_drafts": 6}, "needs prompt lookup on"),
    ],
)
def test_lookup_drafts_that_cannot_be_met_are_refused(
    target: Transformer, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        create("dflash", target, num_spec_tokens=3, **options)


NEVER_PAYS = StepCost(base=0.02, per_row=0.05, per_proposal=0.05, per_draft=0.05)


class ShadowRecordingPolicy(DraftLengthPolicy):
    """A policy under which no draft pays, keeping each decision's free drafts, remaining tokens and lengths."""

    def __init__(self) -> None:
        super().__init__(6, cost=NEVER_PAYS)
        self._by_source["lookup"] = AcceptanceRates(6, pool_decay=1.0)  # plain counts, to compare exactly
        self.calls: list[tuple[dict[str, FreeDraft], dict[str, int], dict[str, int]]] = []

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: Any) -> dict[str, int]:
        lengths = super().choose(req_ids, base_rows=base_rows, **context)
        self.calls.append((dict(context.get("free_drafts") or {}), dict(context["remaining"]), dict(lengths)))
        return lengths


def shadow_counts(
    calls: Sequence[tuple[dict[str, FreeDraft], dict[str, int], dict[str, int]]], tokens: dict[str, list[int]], k: int
) -> tuple[list[int], list[int]]:
    """Per-position trials and acceptances of the free drafts, recounted from the requests' final tokens: a draft
    is kept at a decision that leaves its request at 0 drafts with none pending, cut to the tokens it may still
    emit, and settles at its first mismatch, when all matched, or (matched part only) when the request ends."""
    trials, accepted = [0] * k, [0] * k

    def outcome(draft: FreeDraft, final: list[int]) -> tuple[float, int, int]:
        j, end = 0, len(final)
        while j < len(draft.tokens) and draft.position + j < end and final[draft.position + j] == draft.tokens[j]:
            j += 1
        if j < len(draft.tokens) and draft.position + j < end:
            return draft.position + j, len(draft.tokens), j
        if j == len(draft.tokens):
            return draft.position + j - 1, j, j
        return math.inf, j, j

    def count(num_drafts: int, num_accepted: int) -> None:
        for pos in range(min(num_accepted + 1, num_drafts)):
            trials[pos] += 1
            accepted[pos] += pos < num_accepted

    pending: dict[str, tuple[float, int, int]] = {}
    for free, remaining, lengths in calls:
        for rid, draft in free.items():
            if lengths[rid]:
                continue
            if rid in pending and pending[rid][0] < draft.position:  # settled by a token it had by now
                count(*pending.pop(rid)[1:])
            if rid not in pending:
                cut = FreeDraft(draft.position, draft.tokens[: min(k, remaining[rid])])
                pending[rid] = outcome(cut, tokens[rid])
    for _, num_drafts, num_accepted in pending.values():
        count(num_drafts, num_accepted)
    return trials, accepted


def test_free_lookup_drafts_are_checked_against_the_output_where_nothing_is_drafted(target: Transformer) -> None:
    """No draft pays: nothing is drafted or probed by lookup, the output is plain decoding's, and the lookup's
    rates hold exactly what its would-be drafts scored against the tokens the requests then emitted."""
    plain = run(Engine(target, CONFIG))
    spec = create("dflash", target, num_spec_tokens=3, lookup=2, lookup_drafts=6)
    policy = ShadowRecordingPolicy()
    with enforce("full"):
        engine = Engine(target, ADAPTIVE, speculator=spec, draft_policy=policy)
        assert run(engine) == plain
    tokens = {f"q{i}": [*p, *out] for i, (p, out) in enumerate(zip(PROMPTS, plain, strict=True))}
    trials, accepted = shadow_counts(policy.calls, tokens, 6)
    pool = policy.acceptance_of("lookup")._pool
    assert pool.trials == trials and pool.accepted == accepted
    assert trials[0] == policy.shadow_outcomes > 5 and 0 < accepted[0] < trials[0] and trials[3] > 0


def test_a_steps_cost_sample_counts_only_the_drafts_the_drafter_proposed(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's drafts run no proposal: the step-cost fit is given the longest draft the wrapped drafter made
    (0 on a step where only lookups drafted), not the longest draft verified next."""
    spec = create("dflash", target, num_spec_tokens=3, lookup=2, lookup_drafts=6)
    assert isinstance(spec, LookupFirst)
    proposed: list[int] = []
    inner_propose = spec.inner.propose

    def propose_inner(step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = inner_propose(step, ctx)
        proposed.append(max(proposal.num_drafts, default=0))
        return proposal

    monkeypatch.setattr(spec.inner, "propose", propose_inner)
    policy = DraftLengthPolicy(spec.num_spec_tokens, cost=DRAFTS_PAY)
    with enforce("full"):
        engine = Engine(target, ADAPTIVE, speculator=spec, draft_policy=policy)
        assert engine.draft_ctx is not None
        samples: list[tuple[int, int, int]] = []
        observe = engine.draft_ctx.step_cost.observe
        looked_up = [0]

        def record(rows: int, max_draft: int, seconds: float) -> None:
            samples.append((max_draft, proposed[-1] if proposed else 0, spec.looked_up - looked_up[0]))
            looked_up[0] = spec.looked_up
            observe(rows, max_draft, seconds)

        monkeypatch.setattr(engine.draft_ctx.step_cost, "observe", record)
        reqs = [engine.add_request(f"q{i}", p, max_tokens=40) for i, p in enumerate(PROMPTS)]
        while engine.has_work:
            proposed.clear()
            engine.step()
        assert [list(r.output) for r in reqs] == run(Engine(target, CONFIG))
    assert all(sampled == made for sampled, made, _ in samples)
    lookup_only = sum(1 for _, made, looked in samples if looked and not made)
    model = sum(1 for _, made, _ in samples if made)
    assert lookup_only > 0 and model > 0, (lookup_only, model)
