"""The bench's losslessness check: greedy speculative output must equal plain greedy output, token for token.

Every greedy run of a backend is compared with the plain run of the same
round (same prompts, same batch). A mismatch is reported with its first
differing position and the target's top-1/top-2 logit gap there, recomputed
with one dense forward over the prompt and the agreed prefix: a gap of zero
is an exact tie, a gap within float noise a near tie (the verify forward
scores K+1 tokens at once, plain decoding one, so reductions run in another
order), anything wider is a real bug. Plain decoding of the same prompt in a
batch of 8 and alone is compared the same way, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from specdec.bench.runner import PLAIN, RunRecord
from specdec.nn.transformer import Transformer


@dataclass(frozen=True)
class TopTwo:
    """The target's two best next tokens after a prefix, and how far apart their logits are."""

    top1: int
    top2: int
    gap: float
    top1_logit: float = 0.0
    """The best logit itself: a bf16 rounding step scales with it."""


@dataclass(frozen=True)
class Mismatch:
    """Where a run first left the reference's greedy output, and why that may be."""

    runner: str
    reference: str
    batch: str
    prompt: str
    repeat: int
    position: int
    expected: int | None
    got: int | None
    gap: float | None
    verdict: str
    tolerance: float | None = None
    """The gap below which this position counted as float noise."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts); ``None`` if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two(target: Transformer, ids: Sequence[int]) -> TopTwo:
    """The target's top-1/top-2 next tokens after ``ids`` (one dense forward, float32 logits)."""
    with torch.inference_mode():
        hidden = target.forward_dense(torch.tensor(list(ids), dtype=torch.int64, device=target.device)).hidden_states
        logits: Float[Tensor, "1 vocab"] = target.compute_logits(hidden[-1:])
    values, indices = logits[0].float().topk(2)
    return TopTwo(int(indices[0]), int(indices[1]), float(values[0] - values[1]), float(values[0]))


def verdict(gap: float | None, tie_tolerance: float) -> str:
    if gap is None:
        return "unexplained: no logits"
    if gap == 0.0:
        return "exact tie"
    if gap <= tie_tolerance:
        return "near tie (float reduction order)"
    return "NOT a tie: a losslessness bug"


def is_tie(verdict_text: str) -> bool:
    """Whether a mismatch's ``verdict`` explains it by a tie (exact or near), which greedy losslessness allows."""
    return "tie" in verdict_text and "NOT" not in verdict_text


GapFn = Callable[[Sequence[int]], TopTwo | None]


@dataclass
class LosslessReport:
    """Greedy comparisons: how many outputs were compared per runner, how many matched, and each mismatch."""

    compared: dict[str, int]
    identical: dict[str, int]
    mismatches: list[Mismatch]
    batching: dict[str, int]
    """Plain greedy alone vs in a batch of 8, same prompts: ``compared`` and ``identical`` counts."""
    batching_mismatches: list[Mismatch]

    @property
    def lossless(self) -> bool:
        """True when every mismatch (if any) is explained by a tie."""
        return all(is_tie(m.verdict) for m in self.mismatches)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lossless": self.lossless,
            "compared": self.compared,
            "identical": self.identical,
            "mismatches": [m.as_dict() for m in self.mismatches],
            "batching": self.batching,
            "batching_mismatches": [m.as_dict() for m in self.batching_mismatches],
        }


def _mismatch(
    runner: str,
    reference: str,
    record: RunRecord,
    prompt_index: int,
    prompt_ids: Mapping[str, Sequence[int]],
    expected: Sequence[int],
    got: Sequence[int],
    gap_fn: GapFn,
    tie_tolerance: float,
    relative_tolerance: float = 0.0,
) -> Mismatch | None:
    pos = first_difference(expected, got)
    if pos is None:
        return None
    name = record.prompt_ids[prompt_index]
    top = gap_fn([*prompt_ids[name], *expected[:pos]]) if name in prompt_ids else None
    gap = None if top is None else top.gap
    tolerance = tie_tolerance + (0.0 if top is None else relative_tolerance * abs(top.top1_logit))
    return Mismatch(
        runner=runner,
        reference=reference,
        batch=record.batch_key,
        prompt=name,
        repeat=record.repeat,
        position=pos,
        expected=expected[pos] if pos < len(expected) else None,
        got=got[pos] if pos < len(got) else None,
        gap=gap,
        verdict=verdict(gap, tolerance),
        tolerance=tolerance,
    )


def check_lossless(
    records: Iterable[RunRecord],
    prompt_ids: Mapping[str, Sequence[int]],
    gap_fn: GapFn,
    *,
    tie_tolerance: float,
    relative_tolerance: float = 0.0,
    reference: str = PLAIN,
    skip: Iterable[str] = (),
) -> LosslessReport:
    """Compare every greedy run with the reference run of its round, and plain alone with plain in a batch.

    ``prompt_ids`` maps prompt names to their token ids (for the logit gap);
    runners in ``skip`` (the transformers peer: another implementation, whose
    float rounding may legitimately differ) are not held to it. A gap counts as
    float noise below ``tie_tolerance + relative_tolerance * |top-1 logit|``.
    """
    skipped = set(skip)
    greedy = [r for r in records if r.temperature == 0.0]
    rounds: dict[tuple[str, float, int], dict[str, RunRecord]] = {}
    for r in greedy:
        rounds.setdefault(r.round_key, {})[r.runner] = r
    compared: dict[str, int] = {}
    identical: dict[str, int] = {}
    mismatches: list[Mismatch] = []
    for runs in rounds.values():
        base = runs.get(reference)
        if base is None:
            continue
        for name, r in runs.items():
            if name == reference or name in skipped:
                continue
            for i, (want, got) in enumerate(zip(base.outputs, r.outputs, strict=True)):
                compared[name] = compared.get(name, 0) + 1
                found = _mismatch(
                    name, reference, r, i, prompt_ids, want, got, gap_fn, tie_tolerance, relative_tolerance
                )
                if found is None:
                    identical[name] = identical.get(name, 0) + 1
                else:
                    mismatches.append(found)
    batching = {"compared": 0, "identical": 0}
    batching_mismatches: list[Mismatch] = []
    alone = {
        (r.suite, r.prompt_ids[0]): r.outputs[0]
        for r in greedy
        if r.runner == reference and r.batch_size == 1 and r.repeat == 0
    }
    for r in greedy:
        if r.runner != reference or r.batch_size == 1 or r.repeat != 0:
            continue
        for i, name in enumerate(r.prompt_ids):
            single = alone.get((r.suite, name))
            if single is None:
                continue
            batching["compared"] += 1
            found = _mismatch(
                f"{reference} (batch {r.batch_size})",
                f"{reference} (batch 1)",
                r,
                i,
                prompt_ids,
                single,
                r.outputs[i],
                gap_fn,
                tie_tolerance,
                relative_tolerance,
            )
            if found is None:
                batching["identical"] += 1
            else:
                batching_mismatches.append(found)
    return LosslessReport(compared, identical, mismatches, batching, batching_mismatches)


def tie_tolerance_for(dtype: torch.dtype) -> float:
    """The absolute part of the noise bound: ~1e-3 for float32 logits (bf16's bound is relative)."""
    return 1e-3 if dtype == torch.float32 else 0.0


BF16_STEPS = 2
"""bf16 logits that differ by at most two rounding steps count as a tie (a step is at most 2^-7 of the value)."""


def relative_tie_tolerance_for(dtype: torch.dtype) -> float:
    """The relative part: bf16 keeps 8 significant bits, so its rounding step grows with the logit."""
    return 0.0 if dtype == torch.float32 else BF16_STEPS * 2.0**-7
