"""The one error type a broken invariant raises, with everything an operator needs."""

from __future__ import annotations

from typing import Any


class ContractViolation(Exception):
    """An invariant of a decoding step does not hold.

    Deliberately not a ``ValueError``: pydantic wraps ``ValueError`` raised in
    validators into ``ValidationError``; this type passes through unchanged, so a
    descriptor that breaks DESC-1 raises the same error as a metadata check.
    """

    def __init__(
        self,
        invariant_id: str,
        statement: str,
        observed: dict[str, Any],
        *,
        descriptor: Any = None,
        step_kind: str | None = None,
        component: str | None = None,
        likely_cause: str | None = None,
    ) -> None:
        self.invariant_id = invariant_id
        self.statement = statement
        self.observed = dict(observed)
        self.descriptor = descriptor
        self.step_kind = step_kind
        self.component = component
        self.likely_cause = likely_cause
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"[{self.invariant_id}] {self.statement}"]
        observed = ", ".join(f"{k}={v!r}" for k, v in self.observed.items())
        lines.append(f"  observed: {observed}")
        if self.descriptor is not None:
            lines.append(f"  descriptor: {self.descriptor!r}")
        if self.step_kind is not None:
            lines.append(f"  step kind: {self.step_kind}")
        if self.component is not None:
            lines.append(f"  component: {self.component}")
        if self.likely_cause is not None:
            lines.append(f"  likely cause: {self.likely_cause}")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the error intact when it crosses a process boundary (gloo tests).
        return (
            _rebuild,
            (
                self.invariant_id,
                self.statement,
                self.observed,
                repr(self.descriptor) if self.descriptor is not None else None,
                self.step_kind,
                self.component,
                self.likely_cause,
            ),
        )


def _rebuild(
    invariant_id: str,
    statement: str,
    observed: dict[str, Any],
    descriptor: Any,
    step_kind: str | None,
    component: str | None,
    likely_cause: str | None,
) -> ContractViolation:
    return ContractViolation(
        invariant_id,
        statement,
        observed,
        descriptor=descriptor,
        step_kind=step_kind,
        component=component,
        likely_cause=likely_cause,
    )
