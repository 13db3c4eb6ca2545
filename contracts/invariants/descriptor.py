"""DESC-*: a descriptor is consistent with its graph mode and with the real batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from contracts.registry import Observed, StepKind, Subject, Tag, ValueReader, invariant, violation

if TYPE_CHECKING:
    from contracts.descriptor import BatchExecutionDescriptor
    from contracts.facts import DescriptorFacts

MODEL_STEPS = {
    StepKind.DISPATCH,
    StepKind.DP_SYNC,
    StepKind.TARGET,
    StepKind.DRAFT_PREFILL,
    StepKind.DRAFT_DECODE,
    StepKind.DRAFT_BLOCK,
    StepKind.DRAFT_HEADS,
}


def _mode(desc: BatchExecutionDescriptor) -> str:
    return desc.cg_mode.name


@invariant(
    "DESC-1",
    "PIECEWISE implies num_reqs is None and uniform_token_count is None.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
    likely_cause="request padding or a uniform batch shape was attached to a piecewise graph, which pads tokens only",
)
def desc_1(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    return _desc_1(facts.desc)


def _desc_1(desc: BatchExecutionDescriptor) -> Observed | None:
    if desc.cg_mode.name == "PIECEWISE" and (desc.num_reqs is not None or desc.uniform_token_count is not None):
        return {"cg_mode": _mode(desc), "num_reqs": desc.num_reqs, "uniform_token_count": desc.uniform_token_count}
    return None


@invariant(
    "DESC-2",
    "FULL implies num_reqs is not None and num_reqs >= the local request count.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
    likely_cause="a FULL graph was chosen for a capture size smaller than the batch",
)
def desc_2(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    desc = facts.desc
    if desc.cg_mode.name == "FULL" and (desc.num_reqs is None or desc.num_reqs < facts.num_reqs):
        return {"cg_mode": _mode(desc), "desc.num_reqs": desc.num_reqs, "local num_reqs": facts.num_reqs}
    return None


def _desc_2(desc: BatchExecutionDescriptor) -> Observed | None:
    if desc.cg_mode.name == "FULL" and desc.num_reqs is None:
        return {"cg_mode": _mode(desc), "num_reqs": None}
    return None


@invariant(
    "DESC-3",
    "NONE (eager) implies num_reqs equals the local request count: eager runs pad no requests.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
    likely_cause="request padding from a graph bucket was kept after falling back to eager",
)
def desc_3(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    desc = facts.desc
    if desc.cg_mode.name == "NONE" and desc.num_reqs != facts.num_reqs:
        return {"cg_mode": _mode(desc), "desc.num_reqs": desc.num_reqs, "local num_reqs": facts.num_reqs}
    return None


def _desc_3(desc: BatchExecutionDescriptor) -> Observed | None:
    if desc.cg_mode.name == "NONE" and desc.num_reqs is None:
        return {"cg_mode": _mode(desc), "num_reqs": None}
    return None


@invariant(
    "DESC-4",
    "Under FULL, uniform_token_count = u implies num_tokens == num_reqs * u.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
    likely_cause="token padding and request padding were rounded to different capture sizes",
)
def desc_4(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    return _desc_4(facts.desc)


def _desc_4(desc: BatchExecutionDescriptor) -> Observed | None:
    u = desc.uniform_token_count
    full = desc.cg_mode.name == "FULL" and u is not None and desc.num_reqs is not None
    if full and desc.num_tokens != desc.num_reqs * u:  # type: ignore[operator]
        return {"num_tokens": desc.num_tokens, "num_reqs": desc.num_reqs, "uniform_token_count": u}
    return None


@invariant(
    "DESC-5",
    "num_tokens >= the real token count, and num_tokens == 0 exactly when every DP rank has no tokens.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
    likely_cause="tokens would be dropped, or an idle rank skipped the dummy step its peers' collectives need",
)
def desc_5(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    desc = facts.desc
    observed = {
        "desc.num_tokens": desc.num_tokens,
        "real num_tokens": facts.num_tokens,
        "all_ranks_idle": facts.all_ranks_idle,
    }
    if desc.num_tokens < facts.num_tokens:
        return observed
    if facts.all_ranks_idle is not None and (desc.num_tokens == 0) != facts.all_ranks_idle:
        return observed
    return None


@invariant(
    "DESC-6",
    "Counts are non-negative, uniform_token_count >= 1 when set, and a descriptor with requests has tokens.",
    tag=Tag.S,
    subject=Subject.DESCRIPTOR,
    step_kinds=MODEL_STEPS,
)
def desc_6(facts: DescriptorFacts, _: ValueReader) -> Observed | None:
    return _desc_6(facts.desc)


def _desc_6(desc: BatchExecutionDescriptor) -> Observed | None:
    bad = (
        desc.num_tokens < 0
        or (desc.num_reqs is not None and desc.num_reqs < 0)
        or (desc.uniform_token_count is not None and desc.uniform_token_count < 1)
        or (desc.num_reqs is not None and desc.num_reqs > 0 and desc.num_tokens == 0)
    )
    if bad:
        return {
            "num_tokens": desc.num_tokens,
            "num_reqs": desc.num_reqs,
            "uniform_token_count": desc.uniform_token_count,
        }
    return None


_INTRINSIC = (("DESC-6", _desc_6), ("DESC-1", _desc_1), ("DESC-2", _desc_2), ("DESC-3", _desc_3), ("DESC-4", _desc_4))


def check_intrinsic(desc: BatchExecutionDescriptor) -> None:
    """The invariants a descriptor satisfies on its own; run by its validator in every mode."""
    for invariant_id, rule in _INTRINSIC:
        observed = rule(desc)
        if observed is not None:
            raise violation(invariant_id, observed, component="BatchExecutionDescriptor")
