"""Enforcement modes and the one entry point that runs the registered checks.

``off`` returns after one attribute read; ``shapes`` runs [S]/[H] checks and
reads only host memory; ``full`` also reads device values, except while a CUDA
graph is being captured (a read there would break the capture).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from contracts.registry import StepKind, Subject, ValueReader, check_crashed, invariants_for, violation
from contracts.tally import record
from contracts.violation import ContractViolation

ENV_VAR = "SPECDEC_CONTRACTS"


class Mode(enum.Enum):
    OFF = "off"
    SHAPES = "shapes"
    FULL = "full"

    @classmethod
    def parse(cls, text: str) -> Mode:
        try:
            return cls(text.strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(f"{ENV_VAR}={text!r} is not a contract mode; expected one of {allowed}") from None


class _Setting:
    """Process-wide (not per-thread): in-process DP ranks are threads and must agree."""

    __slots__ = ("mode",)

    def __init__(self) -> None:
        self.mode = Mode.parse(os.environ.get(ENV_VAR, "off"))


_SETTING = _Setting()
_HOST_READER = ValueReader(allow_device=False)
_DEVICE_READER = ValueReader(allow_device=True)


def current_mode() -> Mode:
    return _SETTING.mode


def set_mode(mode: Mode | str) -> Mode:
    """Set the mode; returns the previous one."""
    previous = _SETTING.mode
    _SETTING.mode = mode if isinstance(mode, Mode) else Mode.parse(mode)
    return previous


@contextmanager
def enforce(mode: Mode | str) -> Iterator[Mode]:
    """Run a block under ``mode`` and restore the previous one afterwards."""
    previous = set_mode(mode)
    try:
        yield _SETTING.mode
    finally:
        _SETTING.mode = previous


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check(
    subject: Subject,
    facts: Any,
    *,
    step_kind: StepKind,
    component: str,
    backend: str | None = None,
    descriptor: Any = None,
) -> None:
    """Run every invariant about ``subject`` that applies to ``step_kind``.

    Raises ``ContractViolation`` for the first broken one, in catalog order, so
    the most basic cause is named first. A check that raises anything else
    (a subject too malformed to inspect: a short tensor, a string count) is
    reported as a violation of that invariant naming the exception.
    """
    mode = _SETTING.mode
    if mode is Mode.OFF:
        return
    full = mode is Mode.FULL and not _capturing()
    reader = _DEVICE_READER if full else _HOST_READER
    record(subject, step_kind, full)  # evidence that checks ran (``contracts.tally``), for a caller that counts
    for inv in invariants_for(subject, step_kind):
        if inv.tag.needs_full and not full:
            continue
        try:
            observed = inv.check(facts, reader)
        except ContractViolation:
            raise
        except Exception as exc:  # a malformed subject: reported as this invariant, never as a crash
            observed = check_crashed(exc)
        if observed is not None:
            cause = observed.pop("likely_cause", None)
            raise violation(
                inv.id,
                observed,
                descriptor=descriptor if descriptor is not None else getattr(facts, "desc", None),
                step_kind=step_kind,
                component=component if backend is None else f"{component} (backend {backend})",
                likely_cause=cause,
            )


def host_violation(
    subject: Subject,
    facts: Any,
    *,
    step_kind: StepKind,
    component: str,
    only: frozenset[str] | None = None,
) -> ContractViolation | None:
    """The first broken invariant among those readable from host values, whatever the mode; returned, not raised.

    For the few guards that hold even with contracts ``off`` because a later
    device op would crash on (or silently mis-index) what they check: the
    callers raise their own error naming the invariant. ``only`` restricts the
    run to those IDs. Nothing is tallied: these are guards, not contract checks.
    """
    for inv in invariants_for(subject, step_kind):
        if inv.tag.needs_full or (only is not None and inv.id not in only):
            continue
        try:
            observed = inv.check(facts, _HOST_READER)
        except Exception as exc:
            observed = check_crashed(exc)
        if observed is not None:
            cause = observed.pop("likely_cause", None)
            return violation(
                inv.id,
                observed,
                descriptor=getattr(facts, "desc", None),
                step_kind=step_kind,
                component=component,
                likely_cause=cause,
            )
    return None
