"""A mutant: one realistic bug, injected at run time around the real code, and the invariant meant to catch it.

What a mutation corpus is written with: ``specdec.testing.mutants`` for the
runtime's own code, ``backends.testing.mutants`` for the built-in drafters, or
a third-party backend's module published under the ``specdec.mutants`` entry
points (``specdec.testing.corpus``). A mutant never edits a source file: its
``apply()`` replaces an attribute of the real module or class for the length
of a block and restores it on exit (``unittest.mock.patch.object``, so an
exception restores it too), so everything around the bug runs as shipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

Apply = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class Mutant:
    """One bug pattern, the backend and configuration family it is run against, and what should catch it."""

    name: str
    description: str
    backend: str
    """The backend name (``specdec.backends`` entry point) the mutant's family runs."""
    family: str
    expected: str
    """An invariant ID, or ``mismatch`` / an exception type where no contract can see the bug."""
    apply: Apply
    also_accepted: tuple[str, ...] = ()
    """Other outcomes that count as the expected catch (a skipped collective: DP-3 or the timeout it causes)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Backend options fixed for the whole run (on top of the family's own)."""
    timeout_s: float = 20.0
    """DP collective timeout: short where the bug makes ranks wait on each other."""

    def accepts(self, caught_by: str | None) -> bool:
        return caught_by is not None and (caught_by == self.expected or caught_by in self.also_accepted)


@contextmanager
def wrapped(owner: object, attr: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Replace ``owner.attr`` (a module's or a class's) by ``wrap(real)`` for the block; restore it on exit."""
    with mock.patch.object(owner, attr, wrap(getattr(owner, attr))):
        yield


def constructed(perturb: Callable[[dict[str, Any]], None]) -> Callable[[Any], Any]:
    """A ``wrap`` for a (data)class: a subclass whose constructor perturbs its keyword arguments first.

    Patched in as the name a builder constructs, it lets the builder's own
    contract check (which runs on the object it built) see the bug.
    """

    def wrap(real: Any) -> Any:
        class Mutated(real):
            def __init__(self, **kw: Any) -> None:
                perturb(kw)
                super().__init__(**kw)

        Mutated.__name__ = Mutated.__qualname__ = real.__name__
        return Mutated

    return wrap


@contextmanager
def together(*applies: Apply) -> Iterator[None]:
    """One bug spread over several helpers, applied (and restored) together."""
    with ExitStack() as stack:
        for apply in applies:
            stack.enter_context(apply())
        yield
