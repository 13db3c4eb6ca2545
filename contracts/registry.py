"""The invariant registry: one entry per invariant, the single source of the catalog."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from contracts.violation import ContractViolation


class Tag(enum.Enum):
    """How much an invariant costs to check, which decides the mode it runs in.

    A mixed tag (``S+H``, ``S+D``) checks shapes always and reads values only
    where the value reader allows it in the current mode.
    """

    S = "S"
    H = "H"
    SH = "S+H"
    SD = "S+D"
    D = "D"
    X = "X"  # cross-rank: checked by comparing what every rank saw

    @property
    def needs_full(self) -> bool:
        return self is Tag.D


class StepKind(enum.Enum):
    """Where in a step an object is checked; invariants apply to some kinds only."""

    DISPATCH = "dispatch"
    DP_SYNC = "dp_sync"
    TARGET = "target"
    DRAFT_PREFILL = "draft_prefill"
    DRAFT_DECODE = "draft_decode"
    DRAFT_BLOCK = "draft_block"
    DRAFT_HEADS = "draft_heads"
    """A KV-less draft forward: heads on the target's hidden states, one row per drafting request, no attention."""
    PROPOSAL = "proposal"
    VERIFY = "verify"
    CACHE = "cache"


class Subject(enum.Enum):
    """The kind of object an invariant is a statement about."""

    DESCRIPTOR = "descriptor"
    DP = "dp"
    BATCH = "batch"
    FORWARD_OUTPUT = "forward_output"
    PROPOSAL = "proposal"
    VERIFIER = "verifier"
    CACHE = "cache"


Observed = dict[str, Any]
CheckFn = Callable[[Any, "ValueReader"], Observed | None]


class ValueReader:
    """The only way a check reads tensor values, so each mode's cost is enforced here.

    ``host`` reads host mirrors (CPU tensors kept beside device ones) in every
    mode; ``device`` reads the tensors a kernel would use, only in ``full`` mode
    and never while a CUDA graph is being captured. Fake and meta tensors are
    never read.
    """

    __slots__ = ("allow_device",)

    def __init__(self, allow_device: bool) -> None:
        self.allow_device = allow_device

    @staticmethod
    def _is_unreadable(t: Any) -> bool:
        return bool(t.is_meta) or isinstance(t, _fake_tensor_type())

    def host(self, t: Any) -> list[Any] | None:
        if t is None or self._is_unreadable(t) or t.device.type != "cpu":
            return None
        return list(t.tolist())

    def device(self, t: Any) -> list[Any] | None:
        # Gated on the mode even for CPU tensors: a check costs the same in a
        # mode whatever device the step runs on, so ``shapes`` stays cheap on CPU too.
        if t is None or not self.allow_device or self._is_unreadable(t):
            return None
        return list(t.tolist())


_FAKE_TENSOR: list[type] = []


def _fake_tensor_type() -> type:
    if not _FAKE_TENSOR:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE_TENSOR.append(FakeTensor)
    return _FAKE_TENSOR[0]


@dataclass(frozen=True)
class Invariant:
    id: str
    statement: str
    tag: Tag
    subject: Subject
    step_kinds: frozenset[StepKind]
    check: CheckFn
    likely_cause: str | None = None
    family: str = field(default="")
    accepts: str | None = None
    """Legitimate conventions the statement allows on purpose (an eager descriptor without a uniform count, a DP pad, ...)."""


def check_crashed(exc: Exception) -> Observed:
    """What a violation reports when its check could not even inspect the subject.

    The exception's type and message are kept, so a malformed value built by
    specdec itself is still traced to its source rather than hidden.
    """
    message = str(exc)
    if len(message) > 300:
        message = message[:300] + f"... ({len(message)} characters)"
    return {
        "check raised": f"{type(exc).__name__}: {message}",
        "likely_cause": "the subject is malformed (a wrong length, rank, type or dtype), so the check could not "
        "inspect it; the exception above says which value",
    }


REGISTRY: dict[str, Invariant] = {}
_INDEX: dict[tuple[Subject, StepKind], tuple[Invariant, ...]] = {}


def invariant(
    id: str,
    statement: str,
    *,
    tag: Tag,
    subject: Subject,
    step_kinds: set[StepKind] | frozenset[StepKind],
    likely_cause: str | None = None,
    accepts: str | None = None,
) -> Callable[[CheckFn], CheckFn]:
    """Register ``check`` under ``id``; the catalog is generated from these entries."""

    def register(check: CheckFn) -> CheckFn:
        if id in REGISTRY:
            raise ValueError(f"invariant {id} registered twice")
        REGISTRY[id] = Invariant(
            id=id,
            statement=statement,
            tag=tag,
            subject=subject,
            step_kinds=frozenset(step_kinds),
            check=check,
            likely_cause=likely_cause,
            family=id.split("-")[0],
            accepts=accepts,
        )
        _INDEX.clear()
        return check

    return register


def invariants_for(subject: Subject, step_kind: StepKind) -> tuple[Invariant, ...]:
    key = (subject, step_kind)
    found = _INDEX.get(key)
    if found is None:
        found = tuple(
            sorted(
                (inv for inv in REGISTRY.values() if inv.subject is subject and step_kind in inv.step_kinds),
                key=_catalog_order,
            )
        )
        _INDEX[key] = found
    return found


def all_invariants() -> Iterator[Invariant]:
    return iter(sorted(REGISTRY.values(), key=_catalog_order))


_FAMILY_ORDER = ["DESC", "DP", "IN", "TGT", "AR", "BLK", "HEAD", "PROP", "VER", "KV"]


def _catalog_order(inv: Invariant) -> tuple[int, int, str]:
    family, _, number = inv.id.partition("-")
    rank = _FAMILY_ORDER.index(family) if family in _FAMILY_ORDER else len(_FAMILY_ORDER)
    return (rank, int(number) if number.isdigit() else 0, inv.id)


def violation(
    invariant_id: str,
    observed: Observed,
    *,
    descriptor: Any = None,
    step_kind: StepKind | None = None,
    component: str | None = None,
    likely_cause: str | None = None,
) -> ContractViolation:
    """Build the error for a registered invariant, with its statement and known cause."""
    inv = REGISTRY[invariant_id]
    return ContractViolation(
        invariant_id,
        inv.statement,
        observed,
        descriptor=descriptor,
        step_kind=step_kind.value if step_kind is not None else None,
        component=component,
        likely_cause=likely_cause if likely_cause is not None else inv.likely_cause,
    )
