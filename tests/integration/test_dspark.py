"""The DSpark drafter: lossless (greedy and sampling) with Markov drafts and capacities, BLK-8, VER-3.

Also the capacity-search bias: deciding whether to propose slot k from
anything that depends on draft k itself (what a search that keeps going past
a non-improving slot does) biases the output; the shipped greedy admission
with its early stop does not.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import Float, Int
from scipy.stats import chisquare
from test_dflash import runs
from test_lossless_sampling import ALPHA, exact_joint, p_value, sample_engine
from torch import Tensor

import contracts
from backends import create
from backends.dflash import DFlashNetwork
from backends.dspark import DSparkHeads, DSparkSpeculator, StepCost, budget_capacity, prefix_mask
from backends.dspark import speculator as dspark_module
from backends.registry import spread_layers
from contracts import ContractViolation, VerifierInput
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams, probabilities
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, Speculator, TargetStep
from specdec.testing.dp_run import DPRunSpec, merged, plain_outputs, run_in_process
from specdec.verifier import verify

CAPACITIES = {
    "full": {"capacity": "full"},
    "threshold": {"capacity": "threshold", "tau": 0.2},
    "budget": {"capacity": "budget", "c0": 1.0, "c1": 0.3},
}


def dspark(k: int, capacity: str) -> Callable[[Transformer], Speculator]:
    return lambda t: create("dspark", t, num_spec_tokens=k, markov_scale=2.0, **CAPACITIES[capacity])


@st.composite
def dspark_runs(draw: st.DrawFn) -> DPRunSpec:
    """The DFlash strategy (DP sizes, graph modes, chunked prefills), with a DSpark drafter instead."""
    spec = draw(runs())
    k = draw(st.integers(1, 5))
    capacity = draw(st.sampled_from(sorted(CAPACITIES)))
    return dataclasses.replace(spec, speculator=dspark(k, capacity))


@settings(max_examples=10)
@given(dspark_runs())
def test_greedy_dspark_output_equals_plain_greedy(spec: DPRunSpec) -> None:
    results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    assert len({r.collectives for r in results}) == 1


def engine(target: Transformer, speculator: Speculator | None) -> Engine:
    return Engine(
        target,
        EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64)),
        speculator=speculator,
    )


def run(
    target: Transformer, speculator: Speculator | None, params: SamplingParams | None = None
) -> tuple[Engine, dict[str, list[int]]]:
    """The engine after running four requests to completion, and their outputs (the engine released them)."""
    e = engine(target, speculator)
    for i in range(4):
        e.add_request(f"q{i}", [3 + i, 17, 40 + i], max_tokens=16, params=params or SamplingParams(temperature=0.0))
    return e, e.run()


@pytest.mark.parametrize("capacity", sorted(CAPACITIES))
def test_capacities_trim_the_verified_drafts_and_satisfy_blk_8(capacity: str) -> None:
    """Full mode reads BLK-8's values every step; truncating capacities verify fewer drafts than K per step."""
    target = Transformer(ModelConfig.tiny(), seed=0)
    with contracts.enforce("full"):
        spec_engine, spec_outputs = run(target, dspark(4, capacity)(target))
    assert spec_outputs == run(target, None)[1]
    drafted = spec_engine.metrics.drafted
    assert drafted > 0
    if capacity != "full":
        full = run(target, dspark(4, "full")(target))[0].metrics.drafted
        assert drafted < full


class OneOrTwo(DraftLengthPolicy):
    """Draft budgets of 1 and 2, by request: a DSpark step then has two slots to draw, not K."""

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        return {r: 1 + i % 2 for i, r in enumerate(req_ids)}


@pytest.mark.parametrize("capacity", sorted(CAPACITIES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dspark_draws_no_slot_past_the_longest_budget(
    capacity: str, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Markov slot is a vocabulary-wide draw: a probe (budget 1) must not pay for K of them."""
    target = Transformer(ModelConfig.tiny(), seed=0)
    draws: list[tuple[int, int]] = []
    real_step, real_propose = DSparkSpeculator._markov_step, DSparkSpeculator.propose
    slots = [0]

    def counting_step(self: DSparkSpeculator, *args: Any) -> Any:
        slots[0] += 1
        return real_step(self, *args)

    def propose(self: DSparkSpeculator, step: TargetStep, ctx: DraftContext) -> Proposal:
        before = slots[0]
        proposal = real_propose(self, step, ctx)
        longest = max((step.draft_budget(r, self.num_spec_tokens) for r in range(step.num_reqs)), default=0)
        draws.append((slots[0] - before, longest))
        return proposal

    monkeypatch.setattr(DSparkSpeculator, "_markov_step", counting_step)
    monkeypatch.setattr(DSparkSpeculator, "propose", propose)
    config = EngineConfig(
        num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_model_len=64), draft_length="adaptive"
    )
    params = SamplingParams(temperature=temperature)
    with contracts.enforce("full"):  # BLK-8 reads the evidence of the slots left empty, VER-* the proposals
        e = Engine(target, config, speculator=dspark(4, capacity)(target), draft_policy=OneOrTwo(4))
        for i in range(4):
            e.add_request(f"q{i}", [3 + i, 17, 40 + i], max_tokens=16, params=params, seed=i)
        outputs = e.run()
    if temperature == 0.0:
        assert outputs == run(target, None)[1]
    assert e.metrics.drafted > 0
    assert draws and all(drawn <= longest for drawn, longest in draws), draws
    assert any(longest == 2 and drawn == 2 for drawn, longest in draws)


# -- lossless sampling -------------------------------------------------------------------------------------------


def small_dspark(capacity: str, caps: Counter[int]) -> DSparkSpeculator:
    """K=2 DSpark on the 6-token target of test_lossless_sampling; ``caps`` records every capacity chosen."""
    from test_lossless_sampling import TARGET as SMALL

    aux = spread_layers(SMALL.config.num_layers, count=5)
    network = DFlashNetwork(SMALL, num_aux=len(aux), seed=3)
    c = SMALL.config
    heads = DSparkHeads(
        c.hidden_size, c.vocab_size, rank=4, seed=7, markov_scale=2.0, confidence_scale=2.0, confidence_bias=1.0
    )
    spec = DSparkSpeculator(
        network,
        heads,
        num_spec_tokens=2,
        aux_layers=aux,
        seed=3,
        capacity=capacity,  # type: ignore[arg-type]
        tau=0.3,
        cost=StepCost(c0=1.0, c1=2e-4),
    )
    real = spec._capacity

    def recording(survival: Float[Tensor, "m k"]) -> Int[Tensor, " m"]:
        cap = real(survival)
        caps.update(cap.tolist())
        return cap

    spec._capacity = recording  # type: ignore[method-assign]
    return spec


@pytest.mark.parametrize("capacity", sorted(CAPACITIES))
def test_dspark_sampling_follows_the_target_distribution(capacity: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import test_lossless_sampling

    monkeypatch.setattr(test_lossless_sampling, "N", 800)  # half the shared sample size: three cases stay fast
    params = SamplingParams(temperature=1.0)
    caps: Counter[int] = Counter()
    counts = sample_engine(lambda: small_dspark(capacity, caps), params, seed=1234)  # type: ignore[arg-type,return-value]
    assert sum(counts.values()) == 800
    if capacity != "full":  # truncation happened, and not always to the same count
        assert caps[2] > 0 and caps[0] + caps[1] > 0, caps
    assert p_value(counts, exact_joint(params)) > ALPHA


def backbone_handed_over(
    self: DSparkSpeculator, corrected: Tensor, backbone: Tensor, params: list[SamplingParams]
) -> Tensor:
    """The bug pattern: the verifier gets softmax(U_k) while the drafts came from the Markov-corrected q."""
    m, k, vocab = backbone.shape
    per_row = [p for p in params for _ in range(k)]
    return probabilities(backbone.float().reshape(m * k, vocab), per_row).view(m, k, vocab)


def test_handing_over_the_backbone_distribution_is_biased(monkeypatch: pytest.MonkeyPatch) -> None:
    """The power check: drafts from the Markov-corrected q, verified against the backbone's q, fail the same test.

    ``shapes`` mode does not see this (VER-3 compares the two distributions' values only in ``full``); the output
    distribution does.
    """
    import test_lossless_sampling

    monkeypatch.setattr(test_lossless_sampling, "N", 800)
    monkeypatch.setattr(DSparkSpeculator, "_verifier_proposal", backbone_handed_over)
    params = SamplingParams(temperature=1.0)
    counts = sample_engine(lambda: small_dspark("full", Counter()), params, seed=1234)  # type: ignore[arg-type,return-value]
    assert p_value(counts, exact_joint(params)) < ALPHA


# -- capacity search bias -----------------------------------------------------------------------------------------

# One request, K = 2, vocabulary 3, fixed target/draft tables. The gain of slot 1 is a constant (it depends on the
# anchor only); the gain of slot 2 depends on the sampled draft x1 (as the survival a_2 = a_1·c_2(x1) does).
P1 = torch.tensor([0.2, 0.5, 0.3])
Q1 = torch.tensor([0.6, 0.2, 0.2])
P2 = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4]])  # P2[x1] = p(y2 | y1 = x1)
Q2 = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
COST = StepCost(c0=1.0, c1=0.5)
TRIALS = 20000


def slot_gains(g1: float, x1: int) -> list[float]:
    """Per-slot gains: g1 before any draft, g2 a function of x1 (high when the first draft is token 0)."""
    return [g1, 0.95 if x1 == 0 else 0.05]


def best_prefix_capacity(gains: list[float], cost: StepCost) -> int:
    """BIASED variant: no early stop. It evaluates every prefix and keeps the global best throughput.

    With g1 non-improving it still takes both slots when g2 is high, i.e. whether slot 1 (draft x1) is proposed at
    all is decided by g2, a function of x1 itself. Capacity is then correlated with the draft it admits: x1 = 0 is
    proposed (and accepted with probability p/q) while other x1 fall back to plain sampling, so y1 over-weights 0.
    """

    def throughput(n: int) -> float:
        return (sum(gains[:n]) + 1) / (cost.c0 + cost.c1 * (1 + n))

    return max(range(len(gains) + 1), key=throughput)


def shipped_capacity(gains: list[float], cost: StepCost) -> int:
    return int(budget_capacity(torch.tensor([gains]), cost)[0])


def simulate(choose: Callable[[list[float], StepCost], int], g1: float, seed: int) -> tuple[Tensor, Tensor]:
    """TRIALS independent single-request steps through the real verifier; returns emitted (y1, y2) (y2 = -1: none)."""
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(Q1, TRIALS, replacement=True, generator=gen)
    x2 = torch.multinomial(Q2[x1], 1, generator=gen).squeeze(1)
    caps = [choose(slot_gains(g1, int(a)), COST) for a in x1.tolist()]
    drafts = torch.stack([x1, x2], dim=1)
    drafts = torch.where(prefix_mask(torch.tensor(caps), 2), drafts, -1)
    rows = []
    for a, c in zip(x1.tolist(), caps, strict=True):
        rows.extend([P1, P2[a], torch.full((3,), 1 / 3)][: c + 1])
    draft_probs = torch.stack([torch.stack([Q1, Q2[a]]) for a in x1.tolist()])
    out = verify(
        VerifierInput(drafts, torch.tensor(caps), torch.stack(rows).log(), draft_probs),
        [SamplingParams(temperature=1.0)] * TRIALS,
        num_spec_tokens=2,
        num_draft_tokens=caps,
        generator=gen,
        sampled_from=draft_probs,
    )
    return out.output_token_ids[:, 0], out.output_token_ids[:, 1]


def fit(tokens: Tensor, probs: Tensor) -> float:
    observed = torch.bincount(tokens, minlength=3).double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    return float(chisquare(observed.tolist(), expected.tolist()).pvalue)


def test_a_capacity_search_without_early_stop_is_biased_and_the_shipped_one_is_not() -> None:
    g1 = 0.3  # slot 1 alone does not pay for itself: T(1) = 1.3 / 2 < T(0) = 1 / 1.5
    assert shipped_capacity(slot_gains(g1, 0), COST) == 0  # the early stop never looks at g2
    assert best_prefix_capacity(slot_gains(g1, 0), COST) == 2 and best_prefix_capacity(slot_gains(g1, 1), COST) == 0
    y1, _ = simulate(best_prefix_capacity, g1, seed=5)
    assert fit(y1, P1) < ALPHA  # expected P(y1) = 0.6·(1/3, 1/2, 1/6) + 0.4·P1 = (0.28, 0.5, 0.22), not P1
    y1, _ = simulate(shipped_capacity, g1, seed=5)
    assert fit(y1, P1) > ALPHA


def test_the_shipped_search_may_depend_on_earlier_drafts_and_stays_lossless() -> None:
    """g1 = 0.9 pays: slot 1 is always admitted, slot 2 only when x1 = 0 — decided before x2 is drawn."""
    g1 = 0.9
    assert [shipped_capacity(slot_gains(g1, a), COST) for a in range(3)] == [2, 1, 1]
    y1, y2 = simulate(shipped_capacity, g1, seed=6)
    assert fit(y1, P1) > ALPHA
    for a in range(3):  # y2 given y1 = a, wherever x1 was accepted (bonus from p, or rejection sampling at slot 2)
        emitted = (y1 == a) & (y2 >= 0)
        assert int(emitted.sum()) > 500
        assert fit(y2[emitted], P2[a]) > ALPHA


# -- contracts through the real drafter -------------------------------------------------------------------------------


def tiny_dspark(target: Transformer, **options: object) -> DSparkSpeculator:
    spec = create("dspark", target, num_spec_tokens=3, **options)
    assert isinstance(spec, DSparkSpeculator)
    return spec


def test_blk_8_catches_a_markov_chain_that_does_not_start_at_the_anchor(monkeypatch: pytest.MonkeyPatch) -> None:
    target = Transformer(ModelConfig.tiny(), seed=0)
    vocab = target.config.vocab_size
    monkeypatch.setattr(DSparkSpeculator, "_markov_start", lambda self, anchors: (anchors + 1) % vocab)
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        run(target, tiny_dspark(target))
    assert info.value.invariant_id == "BLK-8"
    assert "markov first tokens" in info.value.observed


def test_blk_8_catches_a_non_prefix_capacity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    def holed(capacity: Int[Tensor, " r"], k: int) -> Tensor:
        mask = prefix_mask(capacity, k).clone()
        mask[:, 0] = False  # slot 0 dropped, later slots kept: not a prefix
        return mask

    target = Transformer(ModelConfig.tiny(), seed=0)
    monkeypatch.setattr(dspark_module, "prefix_mask", holed)
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        run(target, tiny_dspark(target))
    assert info.value.invariant_id == "BLK-8"
    assert "draft_mask row" in info.value.observed


@pytest.mark.parametrize("top_k", [None, 2], ids=["full-support", "top-k-2"])
def test_ver_3_catches_the_backbone_distribution_handed_over(
    monkeypatch: pytest.MonkeyPatch, top_k: int | None
) -> None:
    """Drafts drawn from the Markov-corrected distribution, the backbone's handed to the verifier: VER-3 in ``full``.

    The engine hands the verifier both the proposal and what the drafter reported drawing from; ``full`` compares
    their values on every drafted slot, so the bug is caught with full-support sampling too, not only where a draft
    has probability 0 under the handed-over proposal.
    """
    target = Transformer(ModelConfig.tiny(), seed=0)
    params = SamplingParams(temperature=1.0, top_k=top_k)
    with contracts.enforce("full"):
        run(target, tiny_dspark(target, markov_scale=20.0), params)  # the honest drafter passes

    monkeypatch.setattr(DSparkSpeculator, "_verifier_proposal", backbone_handed_over)
    with contracts.enforce("shapes"):  # shapes reads no values: the run completes (with a biased output)
        run(target, tiny_dspark(target, markov_scale=20.0), params)
    with contracts.enforce("full"), pytest.raises(ContractViolation) as info:
        run(target, tiny_dspark(target, markov_scale=20.0), params)
    assert info.value.invariant_id == "VER-3"
    assert "max |given - drawn|" in info.value.observed


def test_the_budget_fits_its_step_cost_to_measured_step_times() -> None:
    """Without c0/c1 the budget refits ``c0 + c1 · tokens`` from the engine's step record, and stays lossless."""
    target = Transformer(ModelConfig.tiny(), seed=0)
    spec = tiny_dspark(target, capacity="budget")
    assert spec.measure_cost and spec.cost == StepCost()
    e, outputs = run(target, spec)
    assert e.draft_ctx is not None
    record = e.draft_ctx.step_cost
    assert 0 < len(record.samples) == record.observed < e.metrics.steps  # decode steps only, prefills left out
    assert spec._fitted_at and spec.cost != StepCost()
    assert outputs == run(target, None)[1]
    # Every recorded step drafted K (no step without drafts): no full fit, so c0 + c1 · tokens is fitted directly.
    spec._fitted_at = 0
    record.samples.clear()
    for rows, seconds in [(5, 0.030), (10, 0.041), (15, 0.049), (20, 0.062)]:
        record.observe(rows, 4, seconds)
    record.fitted = None  # a record that never saw a step without drafts keeps no full fit
    spec._refit_cost(e.draft_ctx)
    refit = StepCost.fit([5, 10, 15, 20], [0.030, 0.041, 0.049, 0.062])
    assert (spec.cost.c0, spec.cost.c1) == pytest.approx((refit.c0, refit.c1))
    fixed = tiny_dspark(target, capacity="budget", c0=2.0)
    assert not fixed.measure_cost and fixed.cost == StepCost(c0=2.0, c1=0.05)


def test_under_the_adaptive_draft_length_the_budget_reads_the_engine_fit() -> None:
    """One record of step times: the budget's c1 is the policy's cost per verified row, c0 the rest of a K-draft step."""
    from specdec.step_cost import StepCost as FullCost

    target = Transformer(ModelConfig.tiny(), seed=0)
    spec = tiny_dspark(target, capacity="budget")
    engine = Engine(target, EngineConfig(num_blocks=64, block_size=4, draft_length="adaptive"), speculator=spec)
    assert engine.draft_policy is not None and engine.draft_ctx is not None
    assert engine.draft_ctx.step_cost is engine.draft_policy.cost
    known = FullCost(base=0.01, per_row=0.002, per_proposal=0.004, per_draft=0.001)
    record = engine.draft_ctx.step_cost
    for rows, draft in [(1, 0), (2, 0), (3, 1), (5, 1), (5, 4), (8, 2), (4, 3), (6, 2)] * 2:
        record.observe(rows, draft, known.seconds(rows, draft))
    spec._refit_cost(engine.draft_ctx)
    assert spec.cost.c1 == pytest.approx(known.per_row, rel=1e-6)
    assert spec.cost.c0 == pytest.approx(
        known.base + known.per_proposal + spec.num_spec_tokens * known.per_draft, rel=1e-6
    )
