"""The adaptive draft length: the step-cost fit, acceptance by position, and the batch's best draft lengths."""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec import step_cost
from specdec.draft_length import (
    BASELINE_EVERY,
    CALIBRATION,
    DRAFT_MARGIN,
    AcceptanceRates,
    DraftLengthPolicy,
    ForecastCalibration,
    best_draft_lengths,
    best_drain_lengths,
    predicted_gain,
)
from specdec.shadow_drafts import FreeDraft
from specdec.step_cost import StepCost, StepCostModel, bend_candidates

TRUE = StepCost(base=0.020, per_row=0.0015, per_proposal=0.004, per_draft=0.002)


def test_cost_fit_recovers_the_coefficients_of_noisy_steps() -> None:
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(200):
        rows, draft = rng.randint(1, 40), rng.randint(0, 4)
        model.observe(rows, draft, TRUE.seconds(rows, draft) * rng.uniform(0.97, 1.03))
    fit = model.fitted
    assert fit is not None
    assert fit.base == pytest.approx(TRUE.base, rel=0.1)
    assert fit.per_row == pytest.approx(TRUE.per_row, rel=0.1)
    assert fit.per_proposal == pytest.approx(TRUE.per_proposal, rel=0.35)
    assert fit.per_draft == pytest.approx(TRUE.per_draft, rel=0.2)


def test_cost_fit_leaves_out_steps_that_paid_a_one_time_cost() -> None:
    """The first step of each new row count compiles a kernel (4x a step here): it must not price drafts."""
    model, rng = StepCostModel(), random.Random(1)
    seen: set[int] = set()
    for _ in range(120):
        rows, draft = rng.randint(1, 5), rng.randint(0, 4)
        seconds = TRUE.seconds(rows, draft) * rng.uniform(0.98, 1.02)
        model.observe(rows, draft, seconds * (4.0 if rows not in seen else 1.0))
        seen.add(rows)
    fit = model.fitted
    assert fit is not None
    assert fit.per_row == pytest.approx(TRUE.per_row, rel=0.25)
    assert fit.seconds(5, 4) == pytest.approx(TRUE.seconds(5, 4), rel=0.03)


def test_refits_come_every_few_samples_then_at_a_sixteenth_of_a_full_window(monkeypatch: pytest.MonkeyPatch) -> None:
    model, rng, refits = StepCostModel(window=256, refit_every=4), random.Random(2), []
    real = StepCostModel.refit
    monkeypatch.setattr(StepCostModel, "refit", lambda self: refits.append(self.observed) or real(self))
    for _ in range(600):
        rows, draft = rng.randint(1, 5), rng.randint(0, 4)
        model.observe(rows, draft, TRUE.seconds(rows, draft))
    gaps = {a: b - a for a, b in itertools.pairwise(refits)}
    assert {gap for at, gap in gaps.items() if 20 <= at < 60} == {4}  # the window is short: every refit_every samples
    assert {gap for at, gap in gaps.items() if at >= 300} == {256 // step_cost.REFIT_SHARE}  # full: a sixteenth
    assert model.fitted is not None and model.fitted.seconds(5, 4) == pytest.approx(TRUE.seconds(5, 4), rel=0.02)


def test_cost_fit_waits_until_the_samples_pin_it_down() -> None:
    model = StepCostModel()
    for rows in (1, 2, 3, 4):  # every step drafted the same: drafting cost and base cannot be told apart
        model.observe(rows, 4, TRUE.seconds(rows, 4))
    assert model.fitted is None and not model.identifiable
    model.observe(1, 0, TRUE.seconds(1, 0))
    assert model.fitted is not None
    assert model.fitted.per_draft == 0.0  # one non-zero draft length: per_proposal carries the whole proposal
    assert model.fitted.seconds(1, 4) == pytest.approx(TRUE.seconds(1, 4))


def test_cost_fit_never_prices_a_draft_below_zero() -> None:
    model = StepCostModel()
    # Longer drafts measured faster (noise): the plain fit would give per_draft < 0, i.e. "drafting more is free".
    for rows, draft, t in [(1, 0, 0.02), (2, 1, 0.03), (3, 2, 0.028), (5, 4, 0.025), (1, 0, 0.021), (5, 4, 0.024)]:
        model.observe(rows, draft, t)
    fit = model.fitted
    assert fit is not None and min(fit.per_row, fit.per_proposal, fit.per_draft) >= 0.0


def test_a_fit_never_prices_a_plain_step_at_nothing_or_less() -> None:
    """The policy divides by a plain step's predicted time (a bench run once died of 1.0 / 0.0 at batch 8).

    Rows that get dearer fast make a free base come out negative: the line through
    plain steps of 10, 30 and 50 ms at 8, 16 and 24 rows crosses zero at 4 rows.
    """
    model = StepCostModel()
    for _ in range(4):
        for rows, ms in [(8, 10.0), (16, 30.0), (24, 50.0)]:
            model.observe(rows, 0, ms / 1000)
            model.observe(rows + 8, 2, (ms + 25.0) / 1000)
    fit = model.fitted
    assert fit is not None and fit.base >= 0.0
    assert all(fit.seconds(rows, 0) > 0.0 for rows in range(1, 41))
    policy = DraftLengthPolicy(2, cost=fit)
    assert set(policy.choose(["a", "b"], base_rows=2, remaining={"a": 9, "b": 9}, draining=True)) == {"a", "b"}


def test_a_fit_that_prices_steps_at_nothing_is_not_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    model = StepCostModel(refit_every=1)
    for rows, draft in [(1, 0), (2, 2), (3, 1), (4, 0)]:
        model.observe(rows, draft, TRUE.seconds(rows, draft))
    good = model.fitted
    assert good is not None
    free = StepCost(0.0, 0.0, 0.01, 0.0, bends=((3, 0.01),))
    monkeypatch.setattr(step_cost, "_fit", lambda x, *args, **kwargs: (free, torch.zeros(x.shape[1], dtype=x.dtype)))
    model.observe(5, 0, TRUE.seconds(5, 0))
    assert model.fitted is good


def test_a_known_cost_must_price_every_step() -> None:
    with pytest.raises(ValueError, match="prices a one-row step without drafts at 0"):
        DraftLengthPolicy(2, cost=StepCost(0.0, 0.0, 0.004, 0.002))


def test_a_known_cost_must_not_fall_with_more_rows() -> None:
    """The searches take the fewest drafts that reach a gain, which is the cheapest only if more rows never cost less."""
    with pytest.raises(ValueError, match="prices some step below one with fewer rows or drafts"):
        DraftLengthPolicy(2, cost=StepCost(0.02, 0.001, 0.004, 0.0, bends=((4, -0.002),)))
    DraftLengthPolicy(2, cost=StepCost(0.02, 0.002, 0.004, 0.0, bends=((4, -0.001),)))  # flatter, still rising


STEEPENING = StepCost(base=0.020, per_row=0.0002, per_proposal=0.003, per_draft=0.001, bends=((16, 0.0012),))
"""A forward bound by weight reads up to 16 rows and by arithmetic past them (the shape a CPU shows at batch 8)."""


def _fit_steepening(seed: int) -> StepCost:
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(256):
        rows, draft = rng.randint(8, 40), rng.randint(0, 4)
        model.observe(rows, draft, STEEPENING.seconds(rows, draft) * rng.uniform(0.97, 1.03))
    assert model.fitted is not None
    return model.fitted


def test_cost_fit_follows_a_row_cost_that_steepens() -> None:
    fit = _fit_steepening(2)
    for rows in range(8, 41):
        assert fit.seconds(rows, 2) == pytest.approx(STEEPENING.seconds(rows, 2), rel=0.03), rows
    # What a batch of 8 chooses by the fit is what it would choose by the true cost.
    gains = {f"r{i}": [0.6, 0.36, 0.22, 0.13] for i in range(8)}
    by_fit = best_draft_lengths(gains, fit, base_rows=8, num_sampling=8)
    assert by_fit == best_draft_lengths(gains, STEEPENING, base_rows=8, num_sampling=8)


def test_a_straight_line_misprices_the_rows_that_steepen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the fit bends: a line through the same steps is off by more than the tolerance above."""
    monkeypatch.setattr(step_cost, "MAX_BENDS", 0)
    line = _fit_steepening(2)
    assert not line.bends
    assert max(abs(line.seconds(r, 2) / STEEPENING.seconds(r, 2) - 1.0) for r in range(8, 41)) > 0.05


def _observe_mostly_plain(model: StepCostModel, rng: random.Random, slower: float = 1.0) -> None:
    """A full window where drafting stopped paying: plain steps of 8 rows, and 20 probes of one draft each."""
    probes = set(rng.sample(range(256), 20))
    for i in range(256):
        rows, draft = (16, 1) if i in probes else (8, 0)
        model.observe(rows, draft, STEEPENING.seconds(rows, draft) * slower * rng.uniform(0.97, 1.03))


def test_a_window_of_few_drafting_steps_keeps_the_last_full_fits_shape() -> None:
    """Probes of one shape alone cannot tell a verify row's cost from the proposal's; the full fit's shape can."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(256):
        rows, draft = rng.randint(8, 40), rng.randint(0, 4)
        model.observe(rows, draft, STEEPENING.seconds(rows, draft) * rng.uniform(0.97, 1.03))
    _observe_mostly_plain(model, rng)
    assert sum(1 for s in model.samples if s.max_draft) == 20 < step_cost.MIN_DRAFTING_SAMPLES
    fit = model.fitted
    assert fit is not None
    for rows, draft in [(8, 0), (16, 1), (24, 2), (40, 4)]:
        assert fit.seconds(rows, draft) == pytest.approx(STEEPENING.seconds(rows, draft), rel=0.05), (rows, draft)
    # The machine gets busier: the kept shape follows its speed.
    _observe_mostly_plain(model, rng, slower=1.5)
    fit = model.fitted
    assert fit is not None
    for rows, draft in [(8, 0), (16, 1), (24, 2), (40, 4)]:
        assert fit.seconds(rows, draft) == pytest.approx(1.5 * STEEPENING.seconds(rows, draft), rel=0.05), (rows, draft)


def test_enough_drafting_steps_refit_every_coefficient() -> None:
    """A drafting cost that changed is followed once the window holds enough drafting steps to price it."""
    model, rng = StepCostModel(), random.Random(4)
    for _ in range(256):
        rows, draft = rng.randint(8, 40), rng.randint(0, 4)
        model.observe(rows, draft, STEEPENING.seconds(rows, draft) * rng.uniform(0.97, 1.03))
    for _ in range(256):
        rows, draft = rng.randint(1, 40), rng.randint(0, 4)
        model.observe(rows, draft, TRUE.seconds(rows, draft) * rng.uniform(0.97, 1.03))
    fit = model.fitted
    assert fit is not None
    for rows, draft in [(1, 0), (8, 1), (24, 2), (40, 4)]:
        assert fit.seconds(rows, draft) == pytest.approx(TRUE.seconds(rows, draft), rel=0.05), (rows, draft)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=60))
def test_bends_sit_at_measured_row_counts_inside_the_range_spaced_apart(rows: list[int]) -> None:
    knees = bend_candidates(rows)
    assert len(knees) <= step_cost.MAX_BENDS
    assert all(k in rows and min(rows) < k < max(rows) for k in knees)
    assert all(b >= step_cost.BEND_SPACING * a for a, b in zip([min(rows), *knees], knees, strict=False))


@pytest.mark.parametrize("bad", [(0, 0, 0.01), (1, -1, 0.01), (1, 0, 0.0), (1, 0, float("nan"))])
def test_a_bad_step_sample_is_refused(bad: tuple[int, int, float]) -> None:
    with pytest.raises(ValueError, match="step sample"):
        StepCostModel().observe(*bad)


def test_acceptance_counts_each_position_given_the_ones_before() -> None:
    rates = AcceptanceRates(4, pool_decay=1.0)
    rates.record("a", 4, 1)  # position 1 accepted, 2 rejected, 3 and 4 never verified
    rates.record("a", 4, 4)
    assert rates.pooled() == [pytest.approx(3 / 4), pytest.approx(2 / 4), pytest.approx(2 / 3), pytest.approx(2 / 3)]
    assert rates.gains("b") == pytest.approx([3 / 4, 3 / 8, 1 / 4, 1 / 6])  # a new request starts at the pool
    rates.forget("a")
    assert rates.rates("a") == rates.pooled()
    with pytest.raises(ValueError, match="accepted"):
        rates.record("a", 2, 3)


def test_a_request_pulls_its_own_estimate_away_from_the_pool() -> None:
    rates = AcceptanceRates(2, pool_decay=1.0)
    for _ in range(20):
        rates.record("good", 2, 2)
        rates.record("bad", 2, 0)
    assert rates.rates("good")[0] > 0.85 and rates.rates("bad")[0] < 0.15


def test_the_policy_drafts_all_k_for_a_drafter_the_target_agrees_with() -> None:
    assert best_draft_lengths({"a": [0.95, 0.9, 0.85, 0.8]}, TRUE, base_rows=1, num_sampling=1) == {"a": 4}


def test_the_policy_drafts_nothing_when_drafts_are_rejected() -> None:
    assert best_draft_lengths({"a": [0.05, 0.0, 0.0, 0.0]}, TRUE, base_rows=1, num_sampling=1) == {"a": 0}


def test_the_policy_drafts_only_for_the_requests_that_pay() -> None:
    cheap = StepCost(base=0.02, per_row=0.001, per_proposal=0.0, per_draft=0.0)
    lengths = best_draft_lengths({"good": [0.9, 0.8], "bad": [0.01, 0.0]}, cheap, base_rows=2, num_sampling=2)
    assert lengths == {"good": 2, "bad": 0}


def test_drafting_must_beat_plain_decoding_by_the_margin() -> None:
    """A predicted gain inside the cost model's error is no reason to draft (``DRAFT_MARGIN``)."""
    cost = StepCost(base=0.02, per_row=0.001, per_proposal=0.0, per_draft=0.0)
    # One draft: (1 + g) tokens in 22 ms against 1 in 21 ms; g = 0.08 predicts +3%, g = 0.16 predicts +11%.
    assert best_draft_lengths({"a": [0.08]}, cost, base_rows=1, num_sampling=1) == {"a": 1}
    assert best_draft_lengths({"a": [0.08]}, cost, base_rows=1, num_sampling=1, margin=0.05) == {"a": 0}
    assert best_draft_lengths({"a": [0.16]}, cost, base_rows=1, num_sampling=1, margin=0.05) == {"a": 1}
    policy = DraftLengthPolicy(1, cost=cost)
    assert policy.margin == DRAFT_MARGIN > 0.0
    for i in range(200):
        policy.record_verification("a", 1, 1 if i % 12 == 0 else 0)
    assert 0.05 < policy.acceptance.gains("a")[0] < 0.12  # predicts a gain of 0-7%: under the margin
    assert policy.choose(["a"], base_rows=1) == {"a": 0}
    with pytest.raises(ValueError, match="margin"):
        DraftLengthPolicy(1, margin=-0.1)


def _longest_proposed(lengths: dict[str, int], free: Collection[str]) -> int:
    return max((k for r, k in lengths.items() if r not in free), default=0)


def _rate(
    lengths: dict[str, int], gains: dict[str, list[float]], cost: StepCost, n: int, free: Collection[str] = ()
) -> float:
    tokens = n + sum(sum(gains[r][:k]) for r, k in lengths.items())
    return tokens / cost.seconds(n + sum(lengths.values()), _longest_proposed(lengths, free))


@st.composite
def batches(draw: st.DrawFn) -> tuple[dict[str, list[float]], StepCost]:
    k = draw(st.integers(1, 3))
    gains: dict[str, list[float]] = {}
    for r in range(draw(st.integers(1, 3))):
        survive, g = 1.0, []
        for _ in range(k):
            survive *= draw(st.floats(0.0, 0.99))
            g.append(survive)
        gains[f"r{r}"] = g
    unit = st.floats(0.0, 0.01)
    per_row = draw(unit)
    # Bends that steepen the row cost (the fit's) or flatten it (a known cost may): the slope stays >= 0.
    extras = st.floats(-0.01, 0.01)
    bends = tuple(sorted(draw(st.dictionaries(st.integers(1, 12), extras, max_size=2)).items()))
    slopes = itertools.accumulate((extra for _, extra in bends), initial=per_row)
    assume(all(slope >= 0.0 for slope in slopes))
    cost = StepCost(draw(st.floats(0.001, 0.05)), per_row, draw(unit), draw(unit), bends=bends)
    return gains, cost


@settings(max_examples=300, deadline=None)
@given(batches(), st.data())
def test_the_chosen_lengths_are_the_best_of_every_combination(
    case: tuple[dict[str, list[float]], StepCost], data: st.DataObject
) -> None:
    """Also where some requests' drafts are free (a lookup's: verify rows, no proposal)."""
    gains, cost = case
    free = data.draw(st.sets(st.sampled_from(sorted(gains))))
    n = len(gains)
    chosen = best_draft_lengths(gains, cost, base_rows=n, num_sampling=n, free=free)
    k = len(next(iter(gains.values())))
    best = max(
        _rate(dict(zip(gains, combo, strict=True)), gains, cost, n, free)
        for combo in itertools.product(range(k + 1), repeat=n)
    )
    assert _rate(chosen, gains, cost, n, free) == pytest.approx(best, rel=1e-8)  # ties within the choice's own 1e-9


def test_a_row_cost_that_flattens_can_make_later_drafts_pay_again() -> None:
    """Rows free past the sixth (a known cost may say so): the second draft lowers the rate, the third and fourth
    raise it past the best so far, so the search must not stop at the first draft that lowers it."""
    flattening = StepCost(base=0.02, per_row=0.01, per_proposal=0.0, per_draft=0.0, bends=((6, -0.01),))
    gains = {"a": [0.9], "b": [0.5], "c": [0.5], "d": [0.5]}
    assert best_draft_lengths(gains, flattening, base_rows=4, num_sampling=4) == dict.fromkeys(gains, 1)


def test_the_policy_calibrates_then_optimises_then_probes_an_idle_request() -> None:
    policy = DraftLengthPolicy(4, probe_every=3, probe_share=1.0)
    seen = [policy.choose(["a"], base_rows=1)["a"] for _ in CALIBRATION]
    assert seen == [4, 0, 2, 4, 1, 0, 3, 4]  # varied lengths, so the cost model can be fitted
    for rows, draft in [(1, 0), (5, 4), (3, 2), (2, 1), (1, 0), (5, 4)]:
        policy.cost.observe(rows, draft, TRUE.seconds(rows, draft))  # what the engine records each decode step
    for _ in range(30):
        policy.record_verification("a", 1, 0)  # every first draft rejected
    after = [policy.choose(["a"], base_rows=1)["a"] for _ in range(6)]
    assert after == [0, 0, 1, 0, 0, 1]  # nothing pays; every third decision probes with one draft


def test_a_known_cost_skips_calibration_and_fitting() -> None:
    policy = DraftLengthPolicy(2, cost=TRUE)
    for _ in range(10):
        policy.record_verification("a", 2, 2)
    assert policy.choose(["a"], base_rows=1) == {"a": 2}
    for rows, draft in [(1, 0), (3, 2), (2, 1)] * 4:  # measured steps that say drafting costs far more
        policy.cost.observe(rows, draft, 1.0 + 10.0 * draft)
    assert policy.cost.fitted is not None and policy.choose(["a"], base_rows=1) == {"a": 2}  # the known cost wins


def test_probes_back_off_until_drafting_pays_again() -> None:
    policy = DraftLengthPolicy(4, probe_every=2, probe_backoff=4, cost=TRUE, probe_share=1.0)
    for _ in range(30):
        policy.record_verification("a", 1, 0)  # nothing pays: "a" sits at 0 drafts

    def decisions(n: int, accept: int | None = None) -> list[int]:
        out = []
        for _ in range(n):
            length = policy.choose(["a"], base_rows=1)["a"]
            out.append(length)
            if length and accept is not None:
                policy.record_verification("a", length, accept)
        return out

    assert decisions(16, accept=0) == [0, 1] + [0, 0, 0, 1] + [0] * 7 + [1] + [0, 0]  # waits 2, 4, 8, then 8 at most
    policy.record_verification("a", 1, 1)  # an accepted draft outside a probe changes no wait
    # Still a wait of 8 (6 more decisions). That probe is accepted, but one acceptance does not make drafting
    # pay, so the wait stays at its cap: accepted probes at a rate that never pays cost no more than rejected ones.
    assert decisions(14, accept=1) == [0] * 5 + [1] + [0] * 7 + [1]
    for _ in range(40):
        policy.record_verification("a", 4, 4)  # now every draft is accepted: drafting pays
    assert policy.choose(["a"], base_rows=1)["a"] > 0
    for _ in range(400):
        policy.record_verification("a", 1, 0)  # and then it stops paying
    # The request drafted because it paid, so its next idle spell probes after probe_every again.
    assert decisions(4, accept=0) == [0, 1, 0, 0]
    policy.forget("a")
    with pytest.raises(ValueError, match="probe_backoff"):
        DraftLengthPolicy(4, probe_backoff=0)


def test_new_requests_join_the_pools_probe_clock_and_its_backed_off_wait() -> None:
    policy = DraftLengthPolicy(4, probe_every=2, probe_backoff=4, cost=TRUE, probe_share=1.0)
    for _ in range(30):
        policy.record_verification("old", 1, 0)  # nothing pays
    probes = []
    for decision in range(1, 31):
        rid = f"short{decision}"  # a stream of requests that each live one decision
        if policy.choose([rid], base_rows=1)[rid]:
            probes.append(decision)
            policy.record_verification(rid, 1, 0)
        policy.forget(rid)
    # None of them lives to its own probe, yet the pool keeps probing, backing off as one request would.
    assert probes == [2, 6, 14, 22, 30]
    # A request that arrives mid-wait probes with the one already waiting, not probe_every after its arrival.
    assert policy.choose(["a"], base_rows=1) == {"a": 0}
    for _ in range(6):
        assert policy.choose(["a", "b"], base_rows=1) == {"a": 0, "b": 0}
    assert policy.choose(["a", "b"], base_rows=1) == {"a": 1, "b": 1}  # the pool's wait of 8 since its last probe
    for rid in ("a", "b"):
        policy.record_verification(rid, 1, 0)
    for _ in range(40):
        policy.record_verification("old", 4, 4)  # drafting pays again, by old's own outcomes
    # "a" drafts on the pool's say-so (one outcome of its own): that says nothing of how its drafts fare, so the
    # pool keeps its backed-off wait of 8.
    assert policy.choose(["a"], base_rows=1)["a"] > 0
    for _ in range(400):
        policy.record_verification("old", 1, 0)  # and stops paying
    assert [policy.choose(["c"], base_rows=1)["c"] for _ in range(8)] == [0] * 7 + [1]
    policy.record_verification("c", 1, 0)
    for _ in range(400):
        policy.record_verification("old", 4, 4)
    assert policy.choose(["old"], base_rows=1)["old"] > 0  # drafts on its own outcomes: drafting pays
    for _ in range(400):
        policy.record_verification("old", 1, 0)  # and stops paying: new requests wait probe_every again
    assert [policy.choose(["d"], base_rows=1)["d"] for _ in range(2)] == [0, 1]


def test_forecasts_that_keep_missing_are_discounted_until_drafting_stops() -> None:
    """A pool built on other requests says 0.8; these requests accept nothing. The misses, not the pool, stop it."""
    cost = StepCost(base=0.02, per_row=0.002, per_proposal=0.0, per_draft=0.0)  # one draft pays from a gain of 0.16
    policy = DraftLengthPolicy(1, cost=cost, probe_every=10_000)  # probes are another test's
    policy.acceptance = AcceptanceRates(1, pool_decay=1.0)
    for i in range(5000):
        policy.acceptance.record(f"old{i % 50}", 1, 1 if i % 5 else 0)
    chosen = []
    for i in range(80):
        rid = f"new{i}"  # each new: its own counts never get a say, only the pool's 0.8
        length = policy.choose([rid], base_rows=1)[rid]
        chosen.append(length)
        if length:
            policy.record_verification(rid, length, 0)
        policy.forget(rid)
    assert policy.acceptance.gains("new-next")[0] == pytest.approx(0.8, abs=0.01)  # the pool still forecasts 0.8
    assert chosen[0] == 1 and chosen[-1] == 0
    stop = chosen.index(0)
    # One draft needs 0.8 x factor > 0.146 (5% margin), so a factor of (0 + 8) / (0.8 n + 8) below 0.18:
    # n = 46 misses without the discount of older ones, a few more with it.
    assert 46 <= stop <= 56 and not any(chosen[stop:])
    discounted = policy.forecast.apply(policy.acceptance.gains("new-next"))[0]
    assert discounted < 1.05 * 0.024 / 0.022 - 1 < policy.acceptance.gains("new-next")[0]  # what one draft must gain


def test_a_forecast_that_holds_is_left_alone() -> None:
    """Drafts accepted exactly as the acceptance model says (K = 3, rates 0.8 / 0.6 / 0.4): the factor stays ~1."""
    policy, rng = DraftLengthPolicy(3, cost=TRUE), random.Random(7)
    for step in range(3000):
        rid = f"r{step // 40}"  # requests of 40 steps each
        length = policy.choose([rid], base_rows=1)[rid]
        accepted = 0
        for rate in (0.8, 0.6, 0.4)[:length]:
            if rng.random() >= rate:
                break
            accepted += 1
        if length:
            policy.record_verification(rid, length, accepted)
        if step % 40 == 39:
            policy.forget(rid)
    assert 0.93 < policy.forecast.factor < 1.07  # ~200 recent expected drafts: a standard error of ~4%


def test_calibrated_gains_stay_chances() -> None:
    calibration = ForecastCalibration(prior=1.0)
    calibration.record(expected=1.0, realized=3)
    assert calibration.factor == pytest.approx(2.0)
    assert calibration.apply([0.9, 0.4, 0.1]) == pytest.approx([1.0, 0.8, 0.2])  # capped at 1, still non-increasing
    with pytest.raises(ValueError, match="forecast outcome"):
        calibration.record(expected=-1.0, realized=0)


def _drain_rate(
    lengths: dict[str, int],
    gains: dict[str, list[float]],
    critical: set[str],
    cost: StepCost,
    free: Collection[str] = (),
) -> float:
    progress = 1.0 + min(sum(gains[r][: lengths[r]]) for r in critical)
    return progress / cost.seconds(len(gains) + sum(lengths.values()), _longest_proposed(lengths, free))


@settings(max_examples=300, deadline=None)
@given(batches(), st.data())
def test_the_drain_lengths_are_the_best_of_every_combination(
    case: tuple[dict[str, list[float]], StepCost], data: st.DataObject
) -> None:
    gains, cost = case
    critical = data.draw(st.sets(st.sampled_from(sorted(gains)), min_size=1))
    free = data.draw(st.sets(st.sampled_from(sorted(gains))))
    chosen = best_drain_lengths(gains, cost, base_rows=len(gains), critical=critical, free=free)
    assert all(chosen[r] == 0 for r in gains if r not in critical)  # drafts outside the critical set buy nothing
    k = len(next(iter(gains.values())))
    best = max(
        _drain_rate(dict(zip(gains, combo, strict=True)), gains, critical, cost, free)
        for combo in itertools.product(range(k + 1), repeat=len(gains))
    )
    assert _drain_rate(chosen, gains, critical, cost, free) == pytest.approx(best, rel=1e-8)


def test_the_drain_search_finds_drafts_that_pay_only_past_the_first() -> None:
    """A costly proposal is paid back only by several drafts: the search may not stop at what the first one earns
    (it stops at a level only when even the most progress there is cannot pay that level's step)."""
    cost = StepCost(base=0.02, per_row=0.0, per_proposal=0.025, per_draft=0.0)
    gains = {"a": [0.99, 0.98, 0.97]}
    assert best_drain_lengths(gains, cost, base_rows=1, critical={"a"}) == {"a": 3}
    assert best_drain_lengths({"a": [0.99, 0.1, 0.05]}, cost, base_rows=1, critical={"a"}) == {"a": 0}
    assert not StepCost(0.02, 0.001, 0.0, 0.0, bends=((4, -0.002),)).monotone  # a hand-given cost may fall
    assert StepCost(0.02, 0.002, 0.0, 0.0, bends=((4, -0.001),)).monotone


def test_a_draining_batch_drafts_for_all_its_critical_requests_or_none() -> None:
    """Three requests accept most drafts and one almost none: in a draining batch that one sets the step count."""
    policy = DraftLengthPolicy(2, cost=StepCost(base=0.02, per_row=0.001, per_proposal=0.0, per_draft=0.0))
    policy.acceptance = AcceptanceRates(2, pool_decay=1.0, request_weight=0.01)
    for _ in range(200):
        for rid in ("a", "b", "c"):
            policy.acceptance.record(rid, 2, 2)
        policy.acceptance.record("slow", 2, 0)
    ids, full = ["a", "b", "c", "slow"], dict.fromkeys(["a", "b", "c", "slow"], 40)
    assert policy.choose(ids, base_rows=4) == {"a": 2, "b": 2, "c": 2, "slow": 0}  # waiting requests: tokens count
    assert policy.choose(ids, base_rows=4, remaining=full, draining=True) == dict.fromkeys(ids, 0)
    # With far fewer tokens left than the others, "slow" finishes first whatever it drafts: they set the pace.
    ahead = {**full, "slow": 10}
    assert policy.choose(ids, base_rows=4, remaining=ahead, draining=True) == {"a": 2, "b": 2, "c": 2, "slow": 0}
    # One token left: the step emits it whatever is drafted, so "a" drafts nothing even with requests waiting.
    assert policy.choose(ids, base_rows=4, remaining={**full, "a": 1})["a"] == 0
    with pytest.raises(ValueError, match="remaining"):
        policy.choose(ids, base_rows=4, draining=True)


def _measured_lengths(first_accept_every: int, decisions: int) -> list[int]:
    """A measuring policy's choices, each step's time fed back as the engine does (rows: last choice + 1)."""
    cost = StepCost(base=0.02, per_row=0.002, per_proposal=0.002, per_draft=0.0)
    policy = DraftLengthPolicy(1, probe_every=10_000)
    policy.acceptance = AcceptanceRates(1, pool_decay=1.0)
    for i in range(400):
        policy.acceptance.record("a", 1, 1 if i % first_accept_every == 0 else 0)
    lengths, last = [], 0
    for _ in range(decisions):
        length = policy.choose(["a"], base_rows=1)["a"]
        policy.cost.observe(1 + last, length, cost.seconds(1 + last, length))
        lengths.append(length)
        last = length
    return lengths[len(CALIBRATION) :]


def test_a_close_call_measures_plain_decoding_again_and_a_clear_one_does_not() -> None:
    # First drafts accepted 1 in 4: one draft predicted ~6% faster than none, a close call.
    close = _measured_lengths(4, 200)
    zeros = [i for i, n in enumerate(close) if n == 0]
    runs = [zeros[i : i + 2] for i in range(0, len(zeros), 2)]
    assert len(runs) >= 4 and all(b == a + 1 for a, b in runs)  # two decisions at 0 drafts each time
    assert all(nxt[0] - run[1] > BASELINE_EVERY for run, nxt in itertools.pairwise(runs))  # only when stale
    # Every first draft accepted: one draft predicted ~70% faster; plain decoding is never re-measured.
    assert all(_measured_lengths(1, 200))


def test_the_predicted_gain_is_the_rate_the_choice_maximised() -> None:
    cost = StepCost(base=0.02, per_row=0.001, per_proposal=0.0, per_draft=0.0)
    gains = {"a": [0.5], "b": [0.1]}
    # Tokens: (2 + 0.5) in 23 ms against 2 in 22 ms. Drain, "b" critical alone: (1 + 0.1) / 24 ms against 1 / 22.
    assert predicted_gain({"a": 1}, gains, cost, base_rows=2) == pytest.approx(2.5 / 0.023 / (2 / 0.022) - 1)
    drain = predicted_gain({"a": 1, "b": 1}, gains, cost, base_rows=2, critical={"b"})
    assert drain == pytest.approx(1.1 / 0.024 / (1 / 0.022) - 1)
    # A 10 ms proposal, paid for "a"'s drafts and not for a free (lookup) one's.
    proposing = StepCost(base=0.02, per_row=0.001, per_proposal=0.01, per_draft=0.0)
    assert predicted_gain({"a": 1}, gains, proposing, base_rows=2) == pytest.approx(2.5 / 0.033 / (2 / 0.022) - 1)
    free = predicted_gain({"a": 1}, gains, proposing, base_rows=2, free={"a"})
    assert free == pytest.approx(2.5 / 0.023 / (2 / 0.022) - 1)


def test_a_free_draft_is_priced_without_the_proposal() -> None:
    """A lookup's drafts cost their verify rows only: with a proposal that costs three plain steps, a request
    whose next drafts are a lookup's (``free_drafts``) drafts, and the same request without them does not."""
    costly = StepCost(base=0.02, per_row=0.0005, per_proposal=0.06, per_draft=0.0)
    policy = DraftLengthPolicy(4, cost=costly)
    for _ in range(40):
        policy.acceptance_of("lookup").record("old", 4, 3)  # the lookup's drafts: most accepted
    sources, draft = {"a": "lookup"}, FreeDraft(10, (1, 2, 3, 4))
    assert policy.choose(["a"], base_rows=1, sources=sources)["a"] == 0
    # 3, not 4: the fourth draft was never accepted.
    assert policy.choose(["a"], base_rows=1, sources=sources, free_drafts={"a": draft})["a"] == 3
    draining = policy.choose(
        ["a"], base_rows=1, sources=sources, free_drafts={"a": draft}, remaining={"a": 40}, draining=True
    )
    assert draining["a"] == 3


def _model_never_lookup_always(*, probe_every: int, probe_backoff: int) -> DraftLengthPolicy:
    """A policy whose pool has seen the model's drafts never accepted and the lookup's always, probes unpriced."""
    policy = DraftLengthPolicy(4, probe_every=probe_every, probe_backoff=probe_backoff, cost=TRUE, probe_share=1.0)
    for _ in range(30):
        policy.record_verification("old", 1, 0)
        policy.acceptance_of("lookup").record("old", 4, 4)
    return policy


def test_a_lookups_hits_do_not_hold_back_the_models_probes() -> None:
    """Lookup hits on every 5th decision, model drafts that never pay: the model is still probed after its waits of
    2, 4, 8, 8 (the idle decisions counted through the hits), and a probe due at a hit that drafts waits for the
    next decision at 0 drafts. Restarted by each hit, the clock never reached 8 again."""
    policy = _model_never_lookup_always(probe_every=2, probe_backoff=4)
    probes = []
    for decision in range(1, 41):
        hit = decision % 5 == 0
        sources = {"a": "lookup" if hit else "model"}
        free = {"a": FreeDraft(decision, (1, 2, 3, 4))} if hit else None
        n = policy.choose(["a"], base_rows=1, sources=sources, free_drafts=free)["a"]
        assert (n == 4) if hit else n in (0, 1)
        if n and not hit:
            probes.append(decision)
        policy.record_verification("a", n, n if hit else 0)
    assert probes == [2, 6, 14, 22, 31, 39]
    policy.forget("a")
    for _ in range(400):
        policy.acceptance_of("lookup").record("old", 4, 0)  # and now the lookup's drafts do not pay either
    # A new request joins the pool's clock, which the last decision's hit did not restart either: 7 more decisions.
    # Its lookup has a draft at each, never worth drafting, and it is probed with one all the same (a batch's
    # requests probe in one step, whatever their source).
    sources, drafts = {"b": "lookup"}, {"b": FreeDraft(50, (1, 2, 3, 4))}
    seen = [policy.choose(["b"], base_rows=1, sources=sources, free_drafts=drafts)["b"] for _ in range(7)]
    assert seen == [0] * 6 + [1]
    policy.record_verification("b", 1, 0)
    policy.forget("b")
    assert [policy.choose(["c"], base_rows=1)["c"] for _ in range(8)] == [0] * 7 + [1]  # b's probe restarted it


def test_probes_that_fell_apart_come_back_into_one_step() -> None:
    """Two requests probe every 4 decisions. At decision 4 b drafts its lookup's tokens while a probes, so b's
    probe waits for decision 5; from then on a request past half its wait joins the other's probe, and the
    batch probes in one step every 4 decisions. Probing each on its own clock took two steps every time."""
    policy = _model_never_lookup_always(probe_every=4, probe_backoff=1)
    probe_steps = []
    for decision in range(1, 33):
        hit = decision == 4
        sources = {"a": "model", "b": "lookup" if hit else "model"}
        free = {"b": FreeDraft(decision, (1, 2, 3, 4))} if hit else None
        lengths = policy.choose(["a", "b"], base_rows=2, sources=sources, free_drafts=free)
        if hit:
            assert lengths == {"a": 1, "b": 4}  # a's probe is due, b drafts its lookup's tokens
        else:
            assert set(lengths.values()) <= {0, 1}
        if lengths["a"] or (lengths["b"] and not hit):
            probe_steps.append(decision)
        for rid, n in lengths.items():
            policy.record_verification(rid, n, n if hit and rid == "b" else 0)
    assert probe_steps == [4, 5, 8, 12, 16, 20, 24, 28, 32]
    assert policy.choose(["a", "b"], base_rows=2) == {"a": 0, "b": 0}  # the joined clocks run on together


def test_each_draft_source_has_its_own_acceptance_rates() -> None:
    """Lookup drafts accepted, the model's rejected: in one batch the lookup request drafts K, the other none."""
    policy = DraftLengthPolicy(4, cost=TRUE)
    sources = {"copying": "lookup", "writing": "model"}
    for _ in range(40):
        lengths = policy.choose(["copying", "writing"], base_rows=2, sources=sources)
        policy.record_verification("copying", lengths["copying"], lengths["copying"])
        policy.record_verification("writing", lengths["writing"], 0)
    assert lengths == {"copying": 4, "writing": 0}
    assert policy.acceptance_of("lookup").pooled()[0] > 0.9 > 0.25 > policy.acceptance.pooled()[0]
    # The same request switching source is judged by its new source's rates, and its outcome counted there.
    policy.choose(["copying"], base_rows=1, sources={"copying": "model"})
    policy.record_verification("copying", 1, 0)
    assert policy.acceptance_of("lookup").pooled()[0] > 0.9
    lengths = policy.choose(["writing"], base_rows=1, sources={"writing": "lookup"})
    assert lengths == {"writing": 4}
    policy.forget("copying")
    assert policy.acceptance_of("lookup").rates("copying") == policy.acceptance_of("lookup").pooled()


def test_a_source_never_drafts_past_its_limit() -> None:
    """A lookup drafting up to 8 before a model of K = 3, both always accepted and rows nearly free: the model's
    requests get 3 (in calibration too), the lookup's 8, a source the limits do not name K."""
    sources, limits = {"copying": "lookup", "writing": "model"}, {"lookup": 8, "model": 3}
    calibrating = DraftLengthPolicy(8)
    seen = [
        calibrating.choose(["copying", "writing"], base_rows=2, sources=sources, limits=limits) for _ in CALIBRATION
    ]
    assert max(s["writing"] for s in seen) == 3 and max(s["copying"] for s in seen) == 8
    policy = DraftLengthPolicy(8, cost=StepCost(base=0.02, per_row=0.0001, per_proposal=0.0, per_draft=0.0))
    for _ in range(40):
        lengths = policy.choose(["copying", "writing"], base_rows=2, sources=sources, limits=limits)
        for rid, n in lengths.items():
            policy.record_verification(rid, n, n)
    assert lengths == {"copying": 8, "writing": 3}
    assert policy.choose(["other"], base_rows=1, sources={"other": "model"}, limits={"lookup": 8}) == {"other": 8}


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0.005, 0.05),
    st.floats(0.0001, 0.004),
    st.floats(0.0, 0.02),
    st.floats(0.0, 0.004),
    st.integers(1, 8),
    st.sampled_from([0.01, 0.05, 0.2]),
)
def test_probes_cost_at_most_their_share_of_the_time(
    base: float, per_row: float, per_proposal: float, per_draft: float, num_reqs: int, share: float
) -> None:
    """Drafts never pay; the probes of a batch, each a step of one draft per request, stay within the share."""
    cost = StepCost(base=base, per_row=per_row, per_proposal=per_proposal, per_draft=per_draft)
    policy = DraftLengthPolicy(4, probe_every=2, probe_backoff=1, cost=cost, margin=10.0, probe_share=share)
    reqs = [f"r{i}" for i in range(num_reqs)]
    probe_steps, decisions = 0, 2_000
    for _ in range(decisions):
        lengths = policy.choose(reqs, base_rows=num_reqs)
        assert set(lengths.values()) <= {0, 1}
        if any(lengths.values()):
            probe_steps += 1
            for rid, n in lengths.items():
                policy.record_verification(rid, n, 0)
    plain = cost.seconds(num_reqs, 0)
    extra = cost.seconds(2 * num_reqs, 1) - plain
    assert probe_steps >= 1  # probes still happen: an estimate that fell too low can recover
    assert probe_steps * extra <= share * decisions * plain + extra  # within the share, give or take one probe
    # And no rarer than the price asks: the wait is the priced one (the backoff is capped at probe_every here).
    wait = max(2, -(-extra // (share * plain)))
    assert probe_steps >= decisions // (wait + 1) - 1


def test_a_dear_probe_waits_longer_than_probe_every() -> None:
    """A probe step 29% dearer than a plain one, at a 1% share: 30 decisions apart, not probe_every's 2."""
    cost = StepCost(base=0.03, per_row=0.001, per_proposal=0.008, per_draft=0.0)  # plain 31 ms, probe 40 ms
    policy = DraftLengthPolicy(4, probe_every=2, probe_backoff=1, cost=cost, margin=10.0)
    probes = [d for d in range(1, 101) if policy.choose(["a"], base_rows=1)["a"]]
    assert probes == [30, 60, 90]
    with pytest.raises(ValueError, match="probe_share"):
        DraftLengthPolicy(4, probe_share=0.0)
