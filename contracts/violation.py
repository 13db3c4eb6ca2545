"""The one error type a broken invariant raises, with everything an operator needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_ITEMS = 16
"""Items of one observed list, tuple, set or mapping shown in a message; the rest are counted."""

MAX_CHARS = 600
"""Characters of one observed string (or other repr) shown in a message; the rest are counted."""

MAX_VALUE_CHARS = 2000
"""Characters of one whole observed value (nested collections included) shown in a message."""


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
        observed = ", ".join(f"{k}={render_observed(v)}" for k, v in self.observed.items())
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


def render_observed(value: Any) -> str:
    """``repr`` of an observed value, with long collections and strings cut and the cut counted.

    A message that lists ten thousand request ids hides the one that matters, so
    every collection shows its first ``MAX_ITEMS`` items and says how many more
    there are; ``ContractViolation.observed`` keeps the full values.
    """
    return _cut_text(_render(value), MAX_VALUE_CHARS)


def _render(value: Any) -> str:
    if isinstance(value, Mapping):
        items = list(value.items())
        shown = [f"{_render(k)}: {_render(v)}" for k, v in items[:MAX_ITEMS]]
        return "{" + ", ".join(shown + _more(len(items))) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        if isinstance(value, (set, frozenset)):
            items = _sorted_if_possible(items)
        shown = [_render(v) for v in items[:MAX_ITEMS]] + _more(len(items))
        if isinstance(value, list):
            return "[" + ", ".join(shown) + "]"
        if isinstance(value, tuple):
            return "(" + ", ".join(shown) + ("," if len(items) == 1 else "") + ")"
        return "{" + ", ".join(shown) + "}" if items else f"{type(value).__name__}()"
    return _cut_text(repr(value))


def _more(count: int) -> list[str]:
    return [f"... ({count - MAX_ITEMS:,} more)"] if count > MAX_ITEMS else []


def _sorted_if_possible(items: list[Any]) -> list[Any]:
    try:
        return sorted(items)
    except TypeError:
        return items


def _cut_text(text: str, limit: int = MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"
