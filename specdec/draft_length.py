"""How many tokens each request drafts next step: as many as pay for themselves, down to none.

A draft is worth its cost only if it is likely to be accepted: draft j of a
request adds one output token exactly when it and every draft before it are
accepted, with chance ``a_1 · ... · a_j`` (``a_i``: the acceptance rate at
position i given the ones before were accepted). The step's cost grows with
every verify row and with the proposal (``specdec.step_cost``). The policy
picks, for the whole batch, the set of drafts that maximises expected output
tokens per second, which may be every request at K (a drafter that agrees
with the target), a few at short lengths, or none at all: then the step is
plain decoding, and the drafter only takes in the new context.

Acceptance rates are counted from verification outcomes: pooled over the
engine, with each request's own counts pulling its estimate away from the
pool as they accumulate. The expected gains are then discounted by how the
drafts the policy chose actually fared against what it expected of them
(``ForecastCalibration``): choosing the drafts whose estimates are highest
favours estimates that came out high by chance, and the estimates' prior
lifts rarely tried positions, so the raw forecast runs optimistic. A request
at 0 drafts is probed with one draft now and then, so an estimate that fell
too low can recover; new requests join the probe schedule the pool is on, those
part way through their wait join a probe that is due (``PROBE_JOIN``), and the
probes are spaced so that they cost at most ``PROBE_SHARE`` of the time.
Drafts that cost nothing to make (a prompt lookup's) teach it without a
probe: for a request at 0 drafts they are checked against the tokens the
target emits (``specdec.shadow_drafts``), and counted under their source.

What a step's tokens are worth depends on whether anyone waits for a slot. With
requests waiting, a request that finishes early frees its slot for the next,
so every token counts, and the policy maximises the batch's tokens per second.
With none waiting the batch only drains: the step count is set by the request
that finishes last, and tokens won for the others only make the batch smaller
sooner (a DSpark run at batch 8 drafted on 16 of 126 steps, got 71 drafts
accepted, and still took the 126 steps of plain decoding). Then the policy
maximises the expected progress of the slowest of the requests with the most
tokens left (``best_drain_lengths``): they all draft, or none does.

The choice depends only on past outcomes and timings, never on the drafts it
limits, so verification stays lossless. It does depend on wall-clock timings,
so seeded sampling under this policy is exact in distribution but not
reproducible token for token; ``fixed`` draft length is.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from specdec.draft_decisions import BASELINE, CALIBRATING, decision_symbol
from specdec.shadow_drafts import FreeDraft, ShadowDrafts, ShadowOutcome
from specdec.step_cost import StepCost, StepCostModel, longest_proposed

DRAFT_MARGIN = 0.05
"""Drafting must beat plain decoding's predicted tokens/s by this share, not merely tie it.

The step-cost fit's predictions are off by ~5% at a typical row count and by up to
20% at the largest ones (a DSpark run at batch 8 on the benchmark CPU, predicted
against measured medians). At break-even such an error turns into a systematic
slowdown: a bench run drafted at batch 8, where it predicted a small gain, and ran at
0.88-0.91x. Where drafting pays clearly (batch 1 on code), the margin changes nothing."""
BASELINE_EVERY = 32
"""Measured steps without one that drafted nothing, after which a close call re-measures plain decoding's step."""
BASELINE_WITHIN = 0.2
"""A close call: the best drafts predicted to beat plain decoding by less than this share.

Once a policy drafts on every step, the step cost it compares against, plain
decoding's, is no longer measured, only extrapolated by the fit, and an
overestimate there keeps it drafting. A DFlash run at batch 8 on the benchmark
CPU fitted 41 ms for a plain step that took 33-35 ms and drafted on 82 of 87
steps at 0.94x. So when the choice is close, the policy drafts nothing for two
decisions (the second step is then a plain step: no drafts to verify, none
proposed), which costs at most 2 steps in 32 of a small gain. Where drafting
pays clearly, no baseline is taken."""
DEFAULT_SOURCE = "model"
"""The source of a request's drafts when the speculator names none (``choose(..., sources=)``)."""
PROBE_SHARE = 0.01
"""Probes may cost at most this share of the time of the plain steps between them.

A probe step proposes and verifies one draft per probing request, which at batch 8
on the benchmark CPU cost 25-30% of a plain step (a DFlash proposal of 7 ms and 8
verify rows against 37 ms): a probe every 16 decisions would cost ~1.7% of the
time where drafting never pays, above that bench's 1.2% noise. So a request's probe waits
at least as many decisions as the fitted cost says keep probes within this share."""
PROBE_JOIN = 0.5
"""A request at 0 drafts this far into its probe wait is probed along with one whose probe is due.

A batch's probe clocks fall apart: a decision where some requests draft from the
model restarts theirs and not the others', and a request whose probe falls due
while it drafts its lookup's tokens probes at its next decision instead. Each
group then probed in a step of its own (DFlash's HumanEval runs at batch 8 and
T = 1: ``p.p`` and ``pp`` where one probe step had done). Joining brings the
clocks back together; a request probes at most 1 / PROBE_JOIN times as often as
its wait says, and only in steps that probe anyway."""
CALIBRATION = (1.0, 0.0, 0.5, 1.0, 0.25, 0.0, 0.75, 1.0)
"""Draft lengths of the first steps, as shares of K (rounded up): varied so the cost model can be fitted."""


@dataclass
class _Counts:
    """Per-position trials and acceptances (position j: draft j was verified after drafts 1..j-1 were accepted)."""

    trials: list[float]
    accepted: list[float]

    @classmethod
    def empty(cls, k: int) -> _Counts:
        return cls([0.0] * k, [0.0] * k)

    def add(self, num_drafts: int, num_accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.trials = [t * decay for t in self.trials]
            self.accepted = [a * decay for a in self.accepted]
        for j in range(min(num_accepted + 1, num_drafts)):
            self.trials[j] += 1.0
            if j < num_accepted:
                self.accepted[j] += 1.0


@dataclass
class AcceptanceRates:
    """Conditional acceptance by position: pooled over requests, and shrunk per request toward the pool."""

    num_spec_tokens: int
    pool_decay: float = 0.995
    """Each new outcome discounts the pool's older ones, so a change of workload shows within a few hundred steps."""
    request_weight: float = 4.0
    """How many of a request's own trials weigh as much as the pool's estimate."""
    _pool: _Counts = field(init=False)
    _requests: dict[str, _Counts] = field(init=False, default_factory=dict)
    _pool_rates: tuple[float, ...] | None = field(init=False, default=None, repr=False, compare=False)
    """``pooled()`` as of the last outcome: read for every request of every decision, changed only by ``record``."""

    def __post_init__(self) -> None:
        self._pool = _Counts.empty(self.num_spec_tokens)

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafts <= self.num_spec_tokens:
            raise ValueError(
                f"request {req_id!r}: {num_accepted} accepted of {num_drafts} drafts, K = {self.num_spec_tokens}"
            )
        if num_drafts == 0:
            return
        self._pool.add(num_drafts, num_accepted, self.pool_decay)
        self._pool_rates = None
        self._requests.setdefault(req_id, _Counts.empty(self.num_spec_tokens)).add(num_drafts, num_accepted)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def own_trials(self, req_id: str) -> float:
        """The request's own verified first drafts: how much of its estimate is its own rather than the pool's."""
        own = self._requests.get(req_id)
        return 0.0 if own is None else own.trials[0]

    def pooled(self) -> list[float]:
        """Pooled rate per position, with one prior success and one failure (0.5 where nothing was seen)."""
        return list(self._pooled())

    def _pooled(self) -> tuple[float, ...]:
        if self._pool_rates is None:
            p = self._pool
            self._pool_rates = tuple((a + 1.0) / (t + 2.0) for a, t in zip(p.accepted, p.trials, strict=True))
        return self._pool_rates

    def rates(self, req_id: str) -> list[float]:
        pool = self._pooled()
        own = self._requests.get(req_id)
        if own is None:
            return list(pool)
        w = self.request_weight
        return [(a + w * q) / (t + w) for a, t, q in zip(own.accepted, own.trials, pool, strict=True)]

    def gains(self, req_id: str, limit: int | None = None) -> list[float]:
        """Expected extra output tokens from draft j (the first ``limit``): the chance it and every draft before it
        are accepted."""
        rates = self.rates(req_id)
        return list(itertools.accumulate(rates[:limit] if limit is not None else rates, operator.mul))


@dataclass
class ForecastCalibration:
    """Accepted drafts against the gains the policy expected of them: the factor its next forecasts are scaled by.

    Measured on the benchmark CPU at batch 8 (HumanEval, three backends, two runs), the
    chosen drafts were accepted 3-7% less often than forecast wherever hundreds were
    drafted, and near break-even that is the difference between a gain and a loss. The
    factor is the discounted ratio of accepted to expected drafts, with ``prior``
    expected drafts' worth of evidence at ratio 1 so that a few outcomes cannot swing it.
    """

    decay: float = 0.995
    """Per recorded verification, as the pooled acceptance counts discount theirs."""
    prior: float = 8.0
    expected: float = 0.0
    realized: float = 0.0

    def record(self, expected: float, realized: int) -> None:
        if not expected >= 0.0 or realized < 0:
            raise ValueError(f"a forecast outcome needs expected >= 0 and realized >= 0, got {expected}, {realized}")
        self.expected = self.expected * self.decay + expected
        self.realized = self.realized * self.decay + realized

    @property
    def factor(self) -> float:
        return (self.realized + self.prior) / (self.expected + self.prior)

    def apply(self, gains: Sequence[float]) -> list[float]:
        """The gains scaled by the factor; none above 1, so they stay chances and stay non-increasing."""
        f = self.factor
        return [g * f if g * f < 1.0 else 1.0 for g in gains]


def best_draft_lengths(
    gains: Mapping[str, Sequence[float]],
    cost: StepCost,
    *,
    base_rows: int,
    num_sampling: int,
    margin: float = 0.0,
    free: Collection[str] = (),
) -> dict[str, int]:
    """Per-request draft lengths maximising expected output tokens per second of the next step.

    ``gains[r][j]`` is what draft j + 1 of request r adds in expectation
    (non-increasing in j); ``base_rows`` the rows the next step verifies
    without any draft, ``num_sampling`` how many of its requests emit a token.
    The drafts of requests in ``free`` (a prompt lookup's) cost their verify
    rows and no proposal. For each longest proposed length m (0: free drafts
    only), the best drafts are taken by gain, the proposed ones up to m, while
    they raise the ratio; the best over every m wins, ties to fewer drafts.
    Any drafting must beat no drafting by the share ``margin``.
    """
    best: dict[str, int] = dict.fromkeys(gains, 0)
    best_rate = num_sampling / cost.seconds(base_rows, 0) * (1.0 + margin)
    # By gain, then position: equal gains never put a request's draft j + 1 before its draft j. One ranking serves
    # every m: its drafts up to length m keep their order.
    ranked = sorted(
        ((g[j], j + 1, rid) for rid, g in gains.items() for j in range(len(g))),
        key=lambda c: (-c[0], c[1]),
    )
    convex = all(extra >= 0.0 for _, extra in cost.bends)
    longest_proposable = max((len(g) for rid, g in gains.items() if rid not in free), default=0)
    # cost.seconds(rows, longest), in the same order of additions, from parts each computed once.
    rows_part = [cost.rows_part(base_rows)]
    proposal_part = [(cost.per_proposal if n else 0.0, cost.per_draft * n) for n in range(longest_proposable + 1)]
    for m in range(0 if any(rid in free for rid in gains) else 1, longest_proposable + 1):
        tokens, rows, lengths, longest = float(num_sampling), base_rows, dict.fromkeys(gains, 0), 0
        rate = tokens / cost.seconds(rows, longest)
        for gain, length, rid in ranked:
            proposed = rid not in free
            if proposed and length > m:
                continue
            settled = longest == m  # from here on a draft adds one row and nothing else to the cost
            tokens += gain
            rows += 1
            lengths[rid] = length
            if proposed and length > longest:
                longest = length
            if rows - base_rows == len(rows_part):
                rows_part.append(cost.rows_part(rows))
            proposal, drafts = proposal_part[longest]
            before, rate = rate, tokens / (rows_part[rows - base_rows] + proposal + drafts)
            if rate > best_rate * (1.0 + 1e-9):
                best_rate, best = rate, dict(lengths)
            elif settled and convex and rate < before:
                # This draft earned less than the rate it joined; the rest earn no more and cost no less per row
                # (a convex row cost), so the rate only falls from here.
                break
    return best


def best_drain_lengths(
    gains: Mapping[str, Sequence[float]],
    cost: StepCost,
    *,
    base_rows: int,
    critical: Collection[str],
    margin: float = 0.0,
    free: Collection[str] = (),
) -> dict[str, int]:
    """Per-request draft lengths maximising the slowest critical request's expected progress per second.

    A draining batch finishes when its last request does, so a step is worth
    ``1 + min over critical r of (gains[r][0] + ... + gains[r][L_r - 1])`` tokens
    of progress (1 without drafts); requests outside ``critical`` draft nothing.
    For a progress level, the cheapest lengths reaching it are each critical
    request's shortest prefix whose gains add up to it, so trying every level
    some prefix attains finds the best (for a cost that grows with rows and
    drafts, ``StepCost.monotone``, as every fit does: with a cost that falls,
    a longer prefix could be cheaper); ties go to fewer drafts. The drafts of
    requests in ``free`` cost their verify rows and no proposal. Drafting must
    beat no drafting by the share ``margin``.
    """
    best: dict[str, int] = dict.fromkeys(gains, 0)
    best_rate = 1.0 / cost.seconds(base_rows, 0) * (1.0 + margin)
    reach = {rid: list(itertools.accumulate(g)) for rid, g in gains.items() if rid in critical}
    if not reach or not all(reach.values()):
        return best  # a critical request that cannot draft holds the batch back: no draft pays
    # Levels go up, and with them every critical request's shortest length, so (with a cost that grows with rows
    # and drafts) the step's cost: once even the most progress there is cannot pay at a level's cost, no higher
    # level can. Where drafting does not pay that ends the search at its first levels.
    most = 1.0 + min(max(cum) for cum in reach.values())
    prune = cost.monotone
    # Each critical request's shortest length only grows with the level: one pointer per request walks its prefix
    # sums once over all levels. A level one of them cannot reach, no higher level reaches either.
    walk = [(cum, rid in free) for rid, cum in reach.items()]
    shortest = [0] * len(walk)
    rows = base_rows + len(walk)  # every critical request drafts at least one
    longest = 0 if all(is_free for _, is_free in walk) else 1
    for level in sorted({c for cum in reach.values() for c in cum}):
        progress = math.inf
        for i, (cum, is_free) in enumerate(walk):
            j = shortest[i]
            while j < len(cum) and cum[j] < level:
                j += 1
            if j == len(cum):
                return best
            if j != shortest[i]:
                rows += j - shortest[i]
                shortest[i] = j
                if not is_free and j >= longest:
                    longest = j + 1
            progress = min(progress, cum[j])
        seconds = cost.seconds(rows, longest)
        if prune and most / seconds <= best_rate * (1.0 + 1e-9):
            break
        rate = (1.0 + progress) / seconds
        if rate > best_rate * (1.0 + 1e-9):
            best_rate = rate
            best = dict.fromkeys(gains, 0)
            best.update((rid, j + 1) for rid, j in zip(reach, shortest, strict=True))
    return best


def predicted_gain(
    lengths: Mapping[str, int],
    gains: Mapping[str, Sequence[float]],
    cost: StepCost,
    *,
    base_rows: int,
    critical: Collection[str] | None = None,
    free: Collection[str] = (),
) -> float:
    """Predicted rate of these lengths over drafting nothing, minus 1: tokens per second, or with ``critical``
    the slowest critical request's progress per second (as ``best_draft_lengths`` and ``best_drain_lengths``)."""

    def worth(n: Mapping[str, int]) -> float:
        gained = {rid: sum(g[: n.get(rid, 0)]) for rid, g in gains.items()}
        if critical is None:
            return float(len(gains) + sum(gained.values()))
        return 1.0 + min((gained[rid] for rid in critical if rid in gained), default=0.0)

    rows = base_rows + sum(lengths.values())
    drafted = worth(lengths) / cost.seconds(rows, longest_proposed(lengths, free))
    return drafted / (worth({}) / cost.seconds(base_rows, 0)) - 1.0


class DraftLengthPolicy:
    """The engine's per-step choice of each request's draft length (``adaptive``), and what it learns from."""

    def __init__(
        self,
        num_spec_tokens: int,
        *,
        probe_every: int = 16,
        probe_backoff: int = 8,
        cost: StepCost | None = None,
        margin: float = DRAFT_MARGIN,
        probe_share: float = PROBE_SHARE,
    ) -> None:
        """``cost``: a known step cost, used as given (no calibration, no fitting): for a machine measured before.

        A request that drafts nothing from the model (a free source's drafts do not
        count) is probed after ``probe_every`` decisions. Each probe doubles its wait,
        up to ``probe_backoff`` times ``probe_every``, and the wait resets only when
        the request drafts from the model again, on its own outcomes, because
        drafting pays (``_drafts_on_own_outcomes``): a probe accepted at a rate that
        still does not pay (sampling at T = 1, open chat) says nothing new, and a
        batch of such requests would otherwise probe on most steps. A probe also
        waits at least as long as keeps probe steps within ``probe_share`` of the
        time (``PROBE_SHARE``), priced by the step cost.
        """
        if not margin >= 0.0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not probe_share > 0.0:
            raise ValueError(f"probe_share must be > 0 (the share of time probes may cost), got {probe_share}")
        if cost is not None and not cost.seconds(1, 0) > 0.0:
            raise ValueError(
                f"the known step cost prices a one-row step without drafts at {cost.seconds(1, 0):g} s: {cost}; "
                "a step takes time (base + per_row must be positive)"
            )
        if cost is not None and not cost.monotone:
            raise ValueError(
                f"the known step cost prices some step below one with fewer rows or drafts: {cost}; the draft-length "
                "searches assume a step costs no less with more (per_proposal, per_draft and the row cost's slope "
                "after each bend must be >= 0)"
            )
        if num_spec_tokens < 1 or probe_every < 1 or probe_backoff < 1:
            raise ValueError(
                "num_spec_tokens, probe_every and probe_backoff must be >= 1, "
                f"got {num_spec_tokens}, {probe_every}, {probe_backoff}"
            )
        self.num_spec_tokens = num_spec_tokens
        self.cost = StepCostModel()
        """Fed by the engine that runs this policy (its ``DraftContext.step_cost``); ignored with a known ``cost``."""
        self.known_cost = cost
        self._by_source: dict[str, AcceptanceRates] = {DEFAULT_SOURCE: AcceptanceRates(num_spec_tokens)}
        self._source: dict[str, str] = {}
        """Per request: the source of the drafts it was last given a length for."""
        self.forecast = ForecastCalibration()
        self._expected: dict[str, list[float]] = {}
        """Per request with drafts in flight: the uncalibrated gains of the drafts it was given, by position."""
        self.margin = margin
        self.probe_every = probe_every
        self.probe_backoff = probe_backoff
        self.probe_share = probe_share
        self.decisions = 0
        self.last_decision = ""
        """The latest decision as one character (``specdec.draft_decisions``): what a run's trace records."""
        self._idle: dict[str, int] = {}
        """Consecutive decisions at 0 drafts, per request: at its probe wait it drafts one token."""
        self._probe_wait: dict[str, int] = {}
        """Decisions at 0 drafts before a request's next probe: ``probe_every``, doubled per rejected probe."""
        self._probing: set[str] = set()
        """Requests whose last decision was a probe, until its verification is recorded."""
        self._pool_wait = probe_every
        """The probe wait a new request starts with: the latest one a probe left, ``probe_every`` once drafting pays."""
        self._pool_idle = 0
        """Decisions since any request drafted or probed: a new request's idle count starts here."""
        self._baseline_left = 0
        """Decisions still to draft nothing so that plain decoding's step is measured again (``BASELINE_EVERY``)."""
        self.shadows = ShadowDrafts()
        """Free drafts of requests left at 0 drafts, checked against their output (``record_output``)."""
        self.shadow_outcomes = 0
        """Outcomes recorded from free drafts rather than verification, over the policy's life."""

    def choose(
        self,
        req_ids: Sequence[str],
        *,
        base_rows: int,
        remaining: Mapping[str, int] | None = None,
        draining: bool = False,
        sources: Mapping[str, str] | None = None,
        limits: Mapping[str, int] | None = None,
        free_drafts: Mapping[str, FreeDraft] | None = None,
    ) -> dict[str, int]:
        """Draft lengths for the requests that may draft next step (each in 0..K).

        ``remaining``: the tokens each request may still emit (max_tokens, model
        length); a step emits at most one more than it drafts, so drafts past that
        are worth nothing. ``draining``: no request waits for a slot, so the
        batch's progress is that of its slowest request among those with the most
        tokens left (within K of the most); it needs ``remaining``. ``sources``:
        where each request's next drafts come from, as the speculator says
        (prompt lookup or the model: the built-in drafters' ``lookup`` option); each source has
        its own acceptance rates (``DEFAULT_SOURCE`` where none is named). ``limits``: the most drafts a
        source gives a request (K where a source is not named): a lookup may draft more than the model
        behind it, and a length the source cannot fill would be priced as rows never verified.
        ``free_drafts``: the drafts some requests would get at no model cost (their source's, as
        ``sources`` names it); their drafts are priced as verify rows without a proposal, and those
        left at 0 drafts have them checked against their output instead (``record_output``).
        """
        lengths = self._choose(
            req_ids,
            base_rows=base_rows,
            remaining=remaining,
            draining=draining,
            sources=sources,
            limits=limits,
            free=frozenset(free_drafts or ()),
        )
        if free_drafts:
            self._shadow(lengths, free_drafts, remaining, limits)
        return lengths

    def _choose(
        self,
        req_ids: Sequence[str],
        *,
        base_rows: int,
        remaining: Mapping[str, int] | None,
        draining: bool,
        sources: Mapping[str, str] | None,
        limits: Mapping[str, int] | None,
        free: frozenset[str],
    ) -> dict[str, int]:
        if draining and remaining is None:
            raise ValueError("a draining batch's critical requests are those with the most tokens left: pass remaining")
        k = self.num_spec_tokens
        self.decisions += 1
        for rid in req_ids:
            self._source[rid] = DEFAULT_SOURCE if sources is None else sources.get(rid, DEFAULT_SOURCE)
        cost = self.known_cost or self.cost.fitted
        if cost is None or (self.known_cost is None and self.decisions <= len(CALIBRATION)):
            share = CALIBRATION[(self.decisions - 1) % len(CALIBRATION)]
            length = min(k, int(-(-share * k // 1)))
            self.last_decision = CALIBRATING
            return {rid: min(length, (limits or {}).get(self._source[rid], k)) for rid in req_ids}
        if self._baseline_left:
            self._baseline_left -= 1
            self.last_decision = BASELINE
            return dict.fromkeys(req_ids, 0)  # not an idle spell of any request: no probe waits move
        raw: dict[str, list[float]] = {}
        for rid in req_ids:
            source = self._source[rid]
            cap = k if limits is None else limits.get(source, k)  # drafts past a source's limit are never made
            if remaining is not None:
                cap = min(cap, max(0, remaining[rid] - 1))  # nor past the last token the request may emit
            raw[rid] = self.acceptance_of(source).gains(rid, cap)
        gains = {rid: self.forecast.apply(g) for rid, g in raw.items()}
        critical: set[str] | None = None
        if draining and remaining is not None and req_ids:
            most = max(remaining[rid] for rid in req_ids)
            critical = {rid for rid in req_ids if remaining[rid] > most - k}
            lengths = best_drain_lengths(
                gains, cost, base_rows=base_rows, critical=critical, margin=self.margin, free=free
            )
        else:
            lengths = best_draft_lengths(
                gains, cost, base_rows=base_rows, num_sampling=len(req_ids), margin=self.margin, free=free
            )
        if self._baseline_is_stale() and any(lengths.values()):
            gain = predicted_gain(lengths, gains, cost, base_rows=base_rows, critical=critical, free=free)
            if gain < BASELINE_WITHIN:
                self._baseline_left = 1
                self.last_decision = BASELINE
                return dict.fromkeys(req_ids, 0)
        probe_floor = self._priced_probe_wait(cost, base_rows, len(req_ids))
        into_wait: dict[str, float] = {}  # per request at 0 drafts: how far its clock is into its probe wait
        for rid in req_ids:
            if lengths[rid] and rid not in free:
                self._idle[rid] = 0
                if self._drafts_on_own_outcomes(rid):
                    self._probe_wait[rid] = self._pool_wait = self.probe_every  # drafting pays: no backoff any more
            else:
                # A new request joins the pool's probe clock with the pool's wait: what the probes of the requests
                # before it found holds for it until its own probe says otherwise. Otherwise every new request
                # would probe after probe_every, and a stream of short requests would probe on every few steps
                # where drafting never pays (sampling at T = 1, open chat).
                # A free source's drafts (a lookup's) say nothing of the model's, so the clock runs on through them
                # too. Restarted by every lookup hit instead, it never reached a backed-off wait of 64 in a
                # HumanEval bench run at batch 1 (hits at most 45 decisions apart), and a drafter whose first
                # prompt went badly drafted on 8 of its 1,282 decisions (EAGLE at 1.27x).
                idle = self._idle[rid] = self._idle.get(rid, self._pool_idle) + 1
                if not lengths[rid]:
                    into_wait[rid] = idle / max(self._probe_wait.setdefault(rid, self._pool_wait), probe_floor)
        probes = []
        if any(share >= 1.0 for share in into_wait.values()):
            # Requests past PROBE_JOIN of their wait join the probe that is due: the step and the proposal are
            # paid for already, and clocks that fell apart come back together.
            for rid, share in into_wait.items():
                if share >= PROBE_JOIN:
                    lengths[rid], self._idle[rid] = 1, 0
                    self._probing.add(rid)
                    probes.append(rid)
        for rid in req_ids:
            if lengths[rid]:
                self._expected[rid] = raw[rid][: lengths[rid]]
        self._pool_idle = 0 if probes or longest_proposed(lengths, free) else self._pool_idle + 1
        self.last_decision = decision_symbol(lengths, free=free, probes=probes)
        return lengths

    def _shadow(
        self,
        lengths: Mapping[str, int],
        free_drafts: Mapping[str, FreeDraft],
        remaining: Mapping[str, int] | None,
        limits: Mapping[str, int] | None,
    ) -> None:
        """Keep the free drafts of requests left at 0 drafts, as many as their source and their budget allow."""
        for rid, n in lengths.items():
            draft = free_drafts.get(rid)
            if n or draft is None or rid in self.shadows:
                continue
            source = self._source[rid]
            cap = min(self.num_spec_tokens, (limits or {}).get(source, self.num_spec_tokens))
            if remaining is not None:
                cap = min(cap, remaining[rid])  # positions the output never reaches say nothing
            if cap > 0:
                self.shadows.start(rid, source, FreeDraft(draft.position, draft.tokens[:cap]))

    def record_output(self, req_id: str, tokens: Sequence[int]) -> None:
        """The request's tokens (prompt then output) after a step: they settle its pending free draft, if any."""
        outcome = self.shadows.observe(req_id, tokens)
        if outcome is not None:
            self._record_shadow(req_id, outcome)

    def _record_shadow(self, req_id: str, outcome: ShadowOutcome) -> None:
        self.acceptance_of(outcome.source).record(req_id, outcome.num_drafts, outcome.num_accepted)
        self.shadow_outcomes += 1

    def _drafts_on_own_outcomes(self, req_id: str) -> bool:
        """Whether the request's estimate rests on its own outcomes (as many first drafts as the pool weighs).

        Only then does a chosen draft say that drafting pays for it, and reset its
        probe wait. A new request's first choices rest on the pool alone, which after
        a change of workload is the old workload's: a bench run on MT-Bench after
        HumanEval chose drafts at the start of most batches of 8 on HumanEval's
        rates, they failed, and each such choice restarted the probes at 16 and 48.
        """
        rates = self.acceptance_of(self._source.get(req_id, DEFAULT_SOURCE))
        return rates.own_trials(req_id) >= rates.request_weight

    def _priced_probe_wait(self, cost: StepCost, base_rows: int, num_reqs: int) -> int:
        """The fewest decisions between probes that keep a probe step of every request within ``probe_share``."""
        plain = cost.seconds(base_rows, 0)
        extra = cost.seconds(base_rows + num_reqs, 1) - plain
        return max(1, math.ceil(extra / (self.probe_share * plain)))

    def _baseline_is_stale(self) -> bool:
        """Measuring, and none of the last ``BASELINE_EVERY`` measured steps drafted nothing."""
        if self.known_cost is not None or len(self.cost.samples) < BASELINE_EVERY:
            return False
        recent = itertools.islice(reversed(self.cost.samples), BASELINE_EVERY)
        return all(sample.max_draft for sample in recent)

    @property
    def acceptance(self) -> AcceptanceRates:
        """Acceptance of the drafts of ``DEFAULT_SOURCE`` (every draft, unless the speculator names sources)."""
        return self._by_source[DEFAULT_SOURCE]

    @acceptance.setter
    def acceptance(self, rates: AcceptanceRates) -> None:
        self._by_source[DEFAULT_SOURCE] = rates

    def acceptance_of(self, source: str) -> AcceptanceRates:
        """The acceptance rates of drafts from ``source`` (a new source starts at the prior)."""
        rates = self._by_source.get(source)
        if rates is None:
            rates = self._by_source[source] = AcceptanceRates(self.num_spec_tokens)
        return rates

    def record_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.acceptance_of(self._source.get(req_id, DEFAULT_SOURCE)).record(req_id, num_drafts, num_accepted)
        expected = self._expected.pop(req_id, None)
        if expected is not None and num_drafts:
            # A drafter may propose fewer than its budget (DSpark's capacity): only the verified drafts were forecast.
            self.forecast.record(sum(expected[:num_drafts]), num_accepted)
        if req_id in self._probing and num_drafts:
            self._probing.discard(req_id)
            wait = self._probe_wait.get(req_id, self.probe_every)
            self._probe_wait[req_id] = self._pool_wait = min(2 * wait, self.probe_every * self.probe_backoff)

    def forget(self, req_id: str) -> None:
        outcome = self.shadows.drop(req_id)
        if outcome is not None:
            self._record_shadow(req_id, outcome)  # before the request's own counts go with it
        for rates in self._by_source.values():
            rates.forget(req_id)
        self._source.pop(req_id, None)
        self._expected.pop(req_id, None)
        self._idle.pop(req_id, None)
        self._probe_wait.pop(req_id, None)
        self._probing.discard(req_id)
