"""Per-request draft capacities: how many of the K drafted slots are actually proposed.

Losslessness of rejection sampling survives truncation as long as whether
slot k is proposed is decided from information available before draft k is
sampled (the context and drafts x_1..x_{k-1}): conditioned on the accepted
prefix, position k then emits either a bonus from p or a rejection-sampled
token, both distributed as p. A search that decides about slot k by looking
at anything derived from x_k or later drafts (e.g. keeps going past a
non-improving slot because the next slot looks good, and the next slot's gain
depends on x_k) correlates the capacity with the drafts and biases the output.
That is why the budget search below stops at the first non-improving
candidate and only ever considers each request's next slot.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


@dataclass(frozen=True)
class StepCost:
    """Verification step cost ``c0 + c1 · verified tokens`` (any time unit; only the ratio matters)."""

    c0: float = 1.0
    c1: float = 0.05

    def __post_init__(self) -> None:
        if self.c0 <= 0 or self.c1 < 0:
            raise ValueError(f"step cost needs c0 > 0 and c1 >= 0, got c0={self.c0}, c1={self.c1}")

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float]) -> StepCost:
        """Least-squares fit of measured (verified tokens, step seconds) pairs; c0, c1 clamped to be valid."""
        if len(tokens) != len(seconds) or len(tokens) < 2:
            raise ValueError("fitting a step cost needs at least two (tokens, seconds) measurements")
        x = torch.tensor([float(t) for t in tokens], dtype=torch.float64)
        y = torch.tensor(list(seconds), dtype=torch.float64)
        design = torch.stack([torch.ones_like(x), x], dim=1)
        c0, c1 = torch.linalg.lstsq(design, y[:, None]).solution.squeeze(1).tolist()
        return cls(c0=max(c0, 1e-9), c1=max(c1, 0.0))


def prefix_mask(capacity: Int[Tensor, " r"], k: int) -> Bool[Tensor, "r k"]:
    """Slot j of request r is proposed iff ``j < capacity[r]``."""
    return torch.arange(k, device=capacity.device)[None, :] < capacity[:, None]


def threshold_capacity(survival: Float[Tensor, "r k"], tau: float) -> Int[Tensor, " r"]:
    """Keep drafts while ``a_k >= tau``; the leading run, so a later slot never re-opens the block."""
    return (survival >= tau).long().cumprod(dim=1).sum(dim=1)


def budget_capacity(gains: Float[Tensor, "r k"], cost: StepCost) -> Int[Tensor, " r"]:
    """Greedy admission maximising ``(expected accepted + requests) / (c0 + c1 · verified tokens)``.

    ``gains[r, k]`` is the expected-acceptance gain of proposing slot k of
    request r (DSpark: the survival ``a_k``); it must depend only on drafts
    before slot k. Candidates are each request's next unadmitted slot; the
    best one is admitted while the throughput strictly improves, and the search
    STOPS at the first candidate that does not improve it. Continuing (skipping
    it, or scanning all prefixes for a global best) would let later gains,
    which depend on the very drafts being admitted, decide about earlier slots:
    part of the losslessness contract, not just an efficiency choice.
    """
    rows, k = gains.shape
    values: list[list[float]] = gains.detach().double().cpu().tolist()
    capacity = [0] * rows
    if rows == 0 or k == 0:
        return torch.zeros(rows, dtype=torch.long, device=gains.device)
    accepted, verified = 0.0, rows  # every request verifies its bonus row
    throughput = (accepted + rows) / (cost.c0 + cost.c1 * verified)
    frontier = [(-values[r][0], r) for r in range(rows)]
    heapq.heapify(frontier)
    while frontier:
        neg_gain, r = heapq.heappop(frontier)
        candidate = (accepted - neg_gain + rows) / (cost.c0 + cost.c1 * (verified + 1))
        if not candidate > throughput:
            break  # the early stop: never look past a non-improving candidate
        accepted, verified, throughput = accepted - neg_gain, verified + 1, candidate
        capacity[r] += 1
        if capacity[r] < k:
            heapq.heappush(frontier, (-values[r][capacity[r]], r))
    return torch.tensor(capacity, dtype=torch.long, device=gains.device)
