"""What a step costs, as a function of what it verifies and drafts: fitted to the engine's own step times.

Speculation pays only when the tokens a step gains outweigh what the extra
verify rows and the proposal cost, and both depend on the machine, the
model, the backend and the batch. So the engine measures instead of
assuming: every decode step's wall time is one sample of

    seconds = base + per_row * rows + sum(extra * max(0, rows - knee) for knee, extra in bends)
              + per_proposal * [drafts proposed] + per_draft * max_draft

where ``rows`` is the target forward's token count (requests plus the drafts
they verify), ``max_draft`` the longest draft the step's proposal made (a
sequential drafter pays per draft position; a block drafter mostly pays
``per_proposal`` once). The cost of rows is piecewise linear and convex: a
forward over a few rows is bound by reading the weights, so each row adds
little; past some row count it is bound by arithmetic, and each row costs
more. Where that knee lies depends on the machine, so the fit places a
candidate bend at each of a few measured row counts (``bend_candidates``)
and lets the data decide how much each one steepens the cost; with none
that pays, the model is a straight line. The fit is least squares over a
sliding window, with every coefficient but ``base`` kept non-negative,
refitted as samples arrive (less often once the window is full); a fit
that prices a one-row plain step at no time or less is refitted with
``base`` non-negative too, and one that still does is not adopted (the
draft-length policy divides by these times).
The drafting coefficients are only as good as the drafting steps in the
window: where drafting stopped paying, the window fills with plain steps, and a
fit over the few drafting ones left (a probe or two a batch) can price a
proposal at nothing. So a refit whose window holds fewer drafting steps than
``MIN_DRAFTING_SAMPLES`` (or than the last full fit had, if that was fewer)
keeps the shape of the last full fit and only rescales it to the window's
steps, which follow the machine's speed (``StepCostModel.refit``).
Steps that prefill are left out: their attention over long prompts is not
what a decode step's draft length changes. So are, at each refit, steps far
off the first fit (``OUTLIER_SPREADS``): a kernel compiled on a shape's first
use or a stall of a shared machine says nothing about the next step.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

FEATURES = ("base", "per_row", "per_proposal", "per_draft")
OUTLIER_SPREADS = 4.0
"""A step whose time lies further than this many median absolute residuals from the fit is left out of the refit."""
REFIT_SHARE = 16
"""A full window is refitted once 1/REFIT_SHARE of it is new (``StepCostModel.refit_interval``)."""
MAX_BENDS = 6
"""Candidate bends of the row cost at most: enough for the shape of a forward's cost, few enough to stay pinned."""
BEND_SPACING = 1.25
"""Consecutive candidate bends lie at least this factor apart in rows."""
MIN_DRAFTING_SAMPLES = 32
"""Drafting steps a window needs for a full refit; with fewer, the last full fit is rescaled instead.

On the benchmark CPU at batch 8 (greedy MT-Bench after HumanEval, DFlash), a window
of 256 steps with 23 drafting ones priced the proposal and the first 14 rows at
nothing, and the policy chose drafts on 13 decisions of a 61-step batch (32 of 94 drafts
accepted). Probes of one shape cannot tell a verify row's cost from the proposal's."""


@dataclass(frozen=True)
class StepCost:
    """Seconds of one decode step, by the linear model above (all coefficients in seconds)."""

    base: float
    per_row: float
    """Seconds per row up to the first bend."""
    per_proposal: float
    per_draft: float
    bends: tuple[tuple[int, float], ...] = ()
    """``(knee, extra)``: past ``knee`` rows each row costs ``extra`` seconds more (``extra >= 0``, knees increasing)."""

    @property
    def monotone(self) -> bool:
        """No step costs less than one with fewer rows and drafts: true of every fit (its costs are non-negative),
        not necessarily of a cost given by hand (a bend may flatten the row cost, but not below level)."""
        slopes = itertools.accumulate((extra for _, extra in sorted(self.bends)), initial=self.per_row)
        return min(self.per_proposal, self.per_draft, *slopes) >= 0.0

    def row_seconds(self, rows: int) -> float:
        return self.per_row * rows + sum(extra * max(0, rows - knee) for knee, extra in self.bends)

    def rows_part(self, rows: int) -> float:
        """The part of ``seconds`` that depends on the rows alone (``base`` included): a search over many
        candidate steps computes it once per row count."""
        return self.base + self.row_seconds(rows)

    def seconds(self, rows: int, max_draft: int) -> float:
        return self.rows_part(rows) + (self.per_proposal if max_draft else 0.0) + self.per_draft * max_draft

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as dear: the same machine, busier or idler."""
        return StepCost(
            self.base * factor,
            self.per_row * factor,
            self.per_proposal * factor,
            self.per_draft * factor,
            bends=tuple((knee, extra * factor) for knee, extra in self.bends),
        )


def longest_proposed(lengths: Mapping[str, int], free: Collection[str]) -> int:
    """The longest draft the drafter proposes: a free source's drafts (a lookup's) run no proposal.

    A step's ``max_draft``, wherever it is priced or recorded: the policy's searches, the engine's step-cost sample
    and the decision a policy writes down."""
    return max((n for rid, n in lengths.items() if rid not in free), default=0)


@dataclass(frozen=True)
class StepSample:
    rows: int
    max_draft: int
    seconds: float


class StepCostModel:
    """Least-squares fit of ``StepCost`` to the last ``window`` measured decode steps.

    ``fitted`` stays None until the samples pin every coefficient down: at
    least two row counts, and both drafting and non-drafting steps
    (``per_draft`` needs a third draft length; without one it stays 0 and
    ``per_proposal`` carries the whole proposal). Until then a caller must not trust a prediction, which is
    why the draft-length policy calibrates first (``specdec.draft_length``).
    """

    def __init__(self, *, window: int = 256, refit_every: int = 4) -> None:
        if window < len(FEATURES) or refit_every < 1:
            raise ValueError(f"window must be >= {len(FEATURES)} and refit_every >= 1, got {window}, {refit_every}")
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.observed = 0
        """Samples seen in all (the window keeps the last ``window``): how a reader tells that new ones arrived."""
        self.refit_every = refit_every
        self.fitted: StepCost | None = None
        self._since_fit = 0
        self._full: tuple[StepCost, int] | None = None
        """The last fit of every coefficient, and how many drafting steps its window held."""

    def observe(self, rows: int, max_draft: int, seconds: float) -> None:
        if rows < 1 or max_draft < 0 or not seconds > 0.0:
            raise ValueError(
                f"a step sample needs rows >= 1, max_draft >= 0, seconds > 0; got {rows}, {max_draft}, {seconds}"
            )
        self.samples.append(StepSample(rows, max_draft, seconds))
        self.observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_interval or self.fitted is None:
            self.refit()

    @property
    def refit_interval(self) -> int:
        """Samples between refits: ``refit_every`` while the window is short, then a sixteenth of what it holds.

        A refit costs ~1.1 ms on a 2-core CPU (a least-squares fit or three over
        256 samples): every 4 steps that was 0.9% of a 33 ms decode step. Once the
        window holds hundreds of samples, 4 more barely move the fit.
        """
        return max(self.refit_every, len(self.samples) // REFIT_SHARE)

    @property
    def identifiable(self) -> bool:
        return _identifiable(list(self.samples))

    def refit(self) -> StepCost | None:
        """Fit the window; a fit that would price some step at no time (or less) is never adopted.

        With too few drafting steps in the window to price drafting
        (``MIN_DRAFTING_SAMPLES``), the last full fit is rescaled to the window instead.
        """
        self._since_fit = 0
        samples = list(self.samples)
        drafting = sum(1 for s in samples if s.max_draft)
        if self._full is not None and drafting < min(MIN_DRAFTING_SAMPLES, self._full[1]):
            self.fitted = _rescaled(self._full[0], samples)
            return self.fitted
        if not _identifiable(samples):
            return self.fitted
        knees = bend_candidates([s.rows for s in samples])
        # One table for every fit of this refit: a row per sample (the design's columns, then the seconds), built
        # once instead of a Python loop per fit and per residual (a refit took ~0.9 ms at 256 samples that way).
        table = torch.tensor([(s.rows, s.max_draft, s.seconds) for s in samples], dtype=torch.float64)
        x, y = _design(table, knees), table[:, 2]
        fit, coef = _fit(x, y, knees)
        used = torch.ones(len(samples), dtype=torch.bool)
        # One slow step must not set the cost for the next 256: the first step of a new row count pays one-time
        # costs (oneDNN compiles a kernel per shape: ~300 ms against a ~80 ms step), and a shared machine stalls.
        residual = (y - x @ coef).abs()
        spread = max(_median(residual), 0.01 * _median(y))
        kept = residual <= OUTLIER_SPREADS * spread
        # The outliers go only if what is left still pins every coefficient: without its plain steps, say, the
        # proposal's indicator equals the constant, and the solver may put the whole cost there (plain steps free).
        n_kept = int(kept.sum())
        if (
            n_kept < len(samples)
            and n_kept >= len(FEATURES) + len(knees)
            and _identifiable([sample for sample, keep in zip(samples, kept.tolist(), strict=True) if keep])
        ):
            used = kept
            fit, _ = _fit(x[used], y[used], knees)
        if not fit.seconds(1, 0) > 0.0:
            # A negative base with steep rows can price a small plain step at nothing: then no free base.
            fit, _ = _fit(x[used], y[used], knees, free_base=False)
        if fit.seconds(1, 0) > 0.0:
            self.fitted = fit
            self._full = (fit, drafting)
        return self.fitted


def _rescaled(cost: StepCost, samples: list[StepSample]) -> StepCost:
    """``cost`` times the median ratio of the samples' seconds to its predictions (a stall moves a median little)."""
    ratios = torch.tensor([s.seconds / cost.seconds(s.rows, s.max_draft) for s in samples], dtype=torch.float64)
    return cost.scaled(_median(ratios))


def _median(values: torch.Tensor) -> float:
    """The median as ``statistics.median`` takes it: the mean of the middle two of an even count."""
    return float(torch.quantile(values, 0.5))


def _identifiable(samples: list[StepSample]) -> bool:
    """At least two row counts, and steps with and without drafts."""
    rows = {s.rows for s in samples}
    drafts = {s.max_draft for s in samples}
    return len(rows) >= 2 and 0 in drafts and len(drafts) >= 2


def _design(table: torch.Tensor, knees: list[int]) -> torch.Tensor:
    """The least-squares design: a column per ``FEATURES`` entry (the proposal's as an indicator), then one per
    knee (the rows past it)."""
    rows, drafts = table[:, 0], table[:, 1]
    columns = [torch.ones_like(rows), rows, (drafts > 0).to(rows.dtype), drafts]
    columns += [(rows - k).clamp(min=0.0) for k in knees]
    return torch.stack(columns, dim=1)


def _fit(
    x: torch.Tensor, y: torch.Tensor, knees: list[int], *, free_base: bool = True
) -> tuple[StepCost, torch.Tensor]:
    """Least squares of the samples with the costs (and, unless ``free_base``, the base) non-negative; also the
    coefficients as a column per design column, for the residuals."""
    # One draft length only (K = 1, or a policy that never varied it): per_proposal absorbs per_draft.
    features = [0, 1, 2, 3] if x[:, 3].unique().numel() >= 3 else [0, 1, 2]  # x[:, 3]: each step's max_draft
    features += [len(FEATURES) + i for i in range(len(knees))]
    solution = _nonnegative_lstsq(x[:, features], y, free_base=free_base)
    coef = [0.0] * (len(FEATURES) + len(knees))
    for i, c in zip(features, solution, strict=True):
        coef[i] = c
    bends = tuple((k, c) for k, c in zip(knees, coef[len(FEATURES) :], strict=True) if c > 0.0)
    base, per_row, per_proposal, per_draft = coef[: len(FEATURES)]
    return StepCost(base, per_row, per_proposal, per_draft, bends=bends), torch.tensor(coef, dtype=torch.float64)


def bend_candidates(rows: list[int]) -> list[int]:
    """Row counts where the row cost may bend: measured ones strictly inside the measured range, spaced out.

    A bend needs samples on both sides to be priced, so neither end of the
    range is one; past the largest measured row count the last slope goes on.
    """
    measured = sorted(set(rows))
    knees: list[int] = []
    last = measured[0]
    for r in measured[1:-1]:
        if r >= BEND_SPACING * last and len(knees) < MAX_BENDS:
            knees.append(r)
            last = r
    return knees


def _nonnegative_lstsq(x: torch.Tensor, y: torch.Tensor, *, free_base: bool = True) -> list[float]:
    """Least squares with every coefficient after the first (with ``free_base=False``, every one) clamped at zero
    (a small active-set loop).

    Timing noise can make a tiny cost come out negative, and a negative
    per-draft cost would tell the policy that drafting more is free.
    """
    active = list(range(x.shape[1]))
    coef = [0.0] * x.shape[1]
    first = 1 if free_base else 0
    for _ in range(x.shape[1]):
        # gelsd: the minimum-norm solution when columns coincide (a window with one row count per draft state);
        # the default driver would zero all but one of them, the base included.
        solution = torch.linalg.lstsq(x[:, active], y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        negative = [i for i, c in zip(active, solution, strict=True) if i >= first and c < 0]
        if not negative:
            coef = [0.0] * x.shape[1]
            for i, c in zip(active, solution, strict=True):
                coef[i] = c
            return coef
        active = [i for i in active if i not in negative]
    return coef
