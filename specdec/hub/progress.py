"""Progress for the slow steps of a pull (download, extraction, dequantization), on stderr with rich.

Library calls default to silence; the CLI passes a ``RichProgress``. A step is a
context manager yielding an ``advance(amount)`` callable, so converters report
progress without knowing how it is shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol, runtime_checkable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

Advance = Callable[[int], None]


@runtime_checkable
class Reporter(Protocol):
    def step(self, description: str, total: int | None = None) -> AbstractContextManager[Advance]:
        """A step of ``total`` units (``None``: unknown, a spinner); the context yields ``advance(units)``."""
        ...

    def note(self, message: str) -> None: ...


class SilentProgress:
    """Reports nothing: the default for library calls and tests."""

    @contextmanager
    def step(self, description: str, total: int | None = None) -> Iterator[Advance]:
        yield lambda amount: None

    def note(self, message: str) -> None:
        pass


class RichProgress:
    """Each step becomes one rich progress line on stderr, left in place with its elapsed time when done."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)

    @contextmanager
    def step(self, description: str, total: int | None = None) -> Iterator[Advance]:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
        with Progress(*columns, TimeElapsedColumn(), console=self.console) as progress:
            task = progress.add_task(description, total=total)
            yield lambda amount: progress.advance(task, amount)
            progress.update(task, completed=total if total is not None else 1, total=total or 1)

    def note(self, message: str) -> None:
        self.console.print(message)
