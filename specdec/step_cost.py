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
refitted as samples arrive.
Steps that prefill are left out: their attention over long prompts is not
what a decode step's draft length changes. So are, at each refit, steps far
off the first fit (``OUTLIER_SPREADS``): a kernel compiled on a shape's first
use or a stall of a shared machine says nothing about the next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

FEATURES = ("base", "per_row", "per_proposal", "per_draft")
OUTLIER_SPREADS = 4.0
"""A step whose time lies further than this many median absolute residuals from the fit is left out of the refit."""
MAX_BENDS = 6
"""Candidate bends of the row cost at most: enough for the shape of a forward's cost, few enough to stay pinned."""
BEND_SPACING = 1.25
"""Consecutive candidate bends lie at least this factor apart in rows."""


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

    def row_seconds(self, rows: int) -> float:
        return self.per_row * rows + sum(extra * max(0, rows - knee) for knee, extra in self.bends)

    def seconds(self, rows: int, max_draft: int) -> float:
        return (
            self.base + self.row_seconds(rows) + (self.per_proposal if max_draft else 0.0) + self.per_draft * max_draft
        )


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

    def observe(self, rows: int, max_draft: int, seconds: float) -> None:
        if rows < 1 or max_draft < 0 or not seconds > 0.0:
            raise ValueError(
                f"a step sample needs rows >= 1, max_draft >= 0, seconds > 0; got {rows}, {max_draft}, {seconds}"
            )
        self.samples.append(StepSample(rows, max_draft, seconds))
        self.observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self.fitted is None:
            self.refit()

    @property
    def identifiable(self) -> bool:
        rows = {s.rows for s in self.samples}
        drafts = {s.max_draft for s in self.samples}
        return len(rows) >= 2 and 0 in drafts and len(drafts) >= 2

    def refit(self) -> StepCost | None:
        self._since_fit = 0
        if not self.identifiable:
            return self.fitted
        knees = bend_candidates([s.rows for s in self.samples])
        x = torch.tensor(
            [
                [1.0, s.rows, 1.0 if s.max_draft else 0.0, s.max_draft, *(max(0, s.rows - k) for k in knees)]
                for s in self.samples
            ],
            dtype=torch.float64,
        )
        y = torch.tensor([s.seconds for s in self.samples], dtype=torch.float64)
        # One draft length only (K = 1, or a policy that never varied it): per_proposal absorbs per_draft.
        features = [0, 1, 2, 3] if len({s.max_draft for s in self.samples}) >= 3 else [0, 1, 2]
        features += [len(FEATURES) + i for i in range(len(knees))]
        x = x[:, features]
        solution = _nonnegative_lstsq(x, y)
        # One slow step must not set the cost for the next 256: the first step of a new row count pays one-time
        # costs (oneDNN compiles a kernel per shape: ~300 ms against a ~80 ms step), and a shared machine stalls.
        residual = y - x @ torch.tensor(solution, dtype=torch.float64)
        spread = max(float(residual.abs().median()), 0.01 * float(y.median()))
        kept = residual.abs() <= OUTLIER_SPREADS * spread
        if not bool(kept.all()) and int(kept.sum()) >= len(features):
            solution = _nonnegative_lstsq(x[kept], y[kept])
        coef = [0.0] * (len(FEATURES) + len(knees))
        for i, c in zip(features, solution, strict=True):
            coef[i] = c
        bends = tuple((k, c) for k, c in zip(knees, coef[len(FEATURES) :], strict=True) if c > 0.0)
        base, per_row, per_proposal, per_draft = coef[: len(FEATURES)]
        self.fitted = StepCost(base, per_row, per_proposal, per_draft, bends=bends)
        return self.fitted


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


def _nonnegative_lstsq(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Least squares with every coefficient after the first clamped at zero (a small active-set loop).

    Timing noise can make a tiny cost come out negative, and a negative
    per-draft cost would tell the policy that drafting more is free.
    """
    active = list(range(x.shape[1]))
    coef = [0.0] * x.shape[1]
    for _ in range(x.shape[1]):
        solution = torch.linalg.lstsq(x[:, active], y.unsqueeze(1)).solution.squeeze(1).tolist()
        negative = [i for i, c in zip(active, solution, strict=True) if i > 0 and c < 0]
        if not negative:
            coef = [0.0] * x.shape[1]
            for i, c in zip(active, solution, strict=True):
                coef[i] = c
            return coef
        active = [i for i in active if i not in negative]
    return coef
