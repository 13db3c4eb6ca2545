"""The step kinds a drafter may run its forwards as, validated where they enter the runtime.

The registry finds the invariants of a forward by its ``StepKind``. A kind it
does not know, above all the string ``"draft_decode"`` in place of
``StepKind.DRAFT_DECODE``, matches no invariant, so every forward of that
drafter would pass unchecked. Such a kind is therefore refused, not converted:
``draft_step_kinds`` is read from the drafter by more than its context (the
engine picks the proposal's checks by it, wrappers copy it), and a converted
copy in one place would leave strings in the others.
"""

from __future__ import annotations

from collections.abc import Set

from contracts import StepKind

DRAFT_STEP_KINDS: frozenset[StepKind] = frozenset(
    {StepKind.DRAFT_PREFILL, StepKind.DRAFT_DECODE, StepKind.DRAFT_BLOCK, StepKind.DRAFT_HEADS}
)
"""What a drafter's forwards can be: the kinds with draft-forward invariants in the registry."""


class StepKindError(ValueError):
    """A drafter named a step kind that is not a draft ``StepKind``: its forwards would be checked by nothing."""


def _allowed() -> str:
    return ", ".join(f"StepKind.{k.name}" for k in sorted(DRAFT_STEP_KINDS, key=lambda k: k.value))


def _member_named(value: object) -> StepKind | None:
    """The ``StepKind`` a string spells, by value (``"draft_decode"``) or by name (``"DRAFT_DECODE"``)."""
    if not isinstance(value, str):
        return None
    for kind in StepKind:
        if value in (kind.value, kind.name):
            return kind
    return None


def _problem(value: object) -> str:
    """What is wrong with one bad kind, and the fix."""
    kind = _member_named(value)
    if kind in DRAFT_STEP_KINDS:
        assert kind is not None
        return f"{value!r} is a string; write StepKind.{kind.name}, not {value!r} (from contracts import StepKind)"
    if isinstance(value, StepKind):
        return f"StepKind.{value.name} is not a draft step kind (the engine checks that step itself)"
    if kind is not None:
        return f"{value!r} is a string, and StepKind.{kind.name} is not a draft step kind either"
    return f"{value!r} ({type(value).__name__}) is not a StepKind"


def declared_step_kinds(backend: str, kinds: object) -> frozenset[StepKind]:
    """A drafter's ``draft_step_kinds`` as a frozenset of draft ``StepKind`` members, or a ``StepKindError``."""
    if isinstance(kinds, str | bytes) or not isinstance(kinds, Set):
        raise StepKindError(
            f"backend {backend!r} declares draft_step_kinds={kinds!r}; expected a frozenset of StepKind members "
            f"({_allowed()}), e.g. frozenset({{StepKind.DRAFT_DECODE}}), or frozenset() for a drafter without forwards"
        )
    bad = [k for k in kinds if not (isinstance(k, StepKind) and k in DRAFT_STEP_KINDS)]
    if bad:
        problems = "; ".join(_problem(k) for k in sorted(bad, key=repr))
        raise StepKindError(
            f"backend {backend!r} declares draft_step_kinds={sorted(kinds, key=repr)!r}: {problems}. A drafter's step kinds are "
            f"{_allowed()}; a kind outside them matches no invariant, so its forwards would be checked by nothing"
        )
    return frozenset(kinds)


def forward_step_kind(backend: str, step_kind: object, declared: frozenset[StepKind]) -> StepKind:
    """The kind a forward runs as (``ctx.forward``): a draft ``StepKind`` the drafter declared, or an error."""
    if not isinstance(step_kind, StepKind) or step_kind not in DRAFT_STEP_KINDS:
        raise StepKindError(
            f"backend {backend!r} ran a forward as {step_kind!r}: {_problem(step_kind)}. A draft forward runs as "
            f"one of {_allowed()}; any other kind matches no invariant, so the forward would be checked by nothing"
        )
    if step_kind not in declared:
        raise StepKindError(
            f"backend {backend!r} ran a {step_kind.value} forward but declared only "
            f"{sorted(k.value for k in declared)}: add StepKind.{step_kind.name} to its draft_step_kinds"
        )
    return step_kind
