"""What each contract mode costs on real decoding: ``none``, ``off``, ``shapes`` and ``full``, interleaved.

``off``, ``shapes`` and ``full`` are the modes of ``contracts.set_mode``.
``none`` is the runtime with its contract entry points removed:
``contracts.check`` (under every name a loaded module bound it to) and the
engine's ``check_proposal`` and ``check_verified`` are swapped for a function that does nothing, so
not even the mode is read; it is the "no contracts" baseline that ``off`` must
be indistinguishable from. (Their guards on draft counts and emitted ids, which hold
in ``off`` too, go as well; guards that read ``current_mode()`` see ``off``.)

Two figures per mode: the wall time relative to ``off`` (median over
interleaved rounds: everything the mode costs, fact building included, but
as noisy as the machine) and, for ``shapes`` and ``full``, the share of the
wall time spent inside the check entry points (timed around the outermost
call: steady, but blind to facts built before a check).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import contracts
import contracts.enforcement
from specdec.bench.runner import Runner, RunRecord, RunSpec
from specdec.bench.suites import Batch

MODES = ("none", "off", "shapes", "full")


def _entry_points() -> list[Callable[..., Any]]:
    from specdec import speculator, verifier

    return [contracts.enforcement.check, speculator.check_proposal, verifier.check_verified]


def _bindings(targets: list[Callable[..., Any]]) -> list[tuple[Any, str, Callable[..., Any]]]:
    """Every (module, attribute, function) where a loaded module holds one of ``targets``."""
    found = []
    wanted = {id(t): t for t in targets}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not isinstance(name, str) or not name.startswith(("contracts", "specdec", "backends")):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in wanted and value is wanted[id(value)]:
                found.append((module, attr, value))
    return found


@contextmanager
def _patched(replace: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    bindings = _bindings(_entry_points())
    for module, attr, fn in bindings:
        setattr(module, attr, replace(fn))
    try:
        yield
    finally:
        for module, attr, fn in bindings:
            setattr(module, attr, fn)


def _nothing(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


class CheckTimer:
    """Wall time spent inside contract entry points (nested calls counted once, at the outermost)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        return timed


@contextmanager
def contract_mode(mode: str, timer: CheckTimer | None = None) -> Iterator[None]:
    """Run a block in ``mode`` (one of ``MODES``); with ``timer``, time the checks (not for ``none``/``off``)."""
    if mode not in MODES:
        raise ValueError(f"unknown contract mode {mode!r}; expected one of {', '.join(MODES)}")
    with ExitStack() as stack:
        stack.enter_context(contracts.enforce("off" if mode == "none" else mode))
        if mode == "none":
            stack.enter_context(_patched(lambda fn: _nothing))
        elif timer is not None and mode in ("shapes", "full"):
            stack.enter_context(_patched(timer.wrap))
        yield


class ModeRunner:
    """Another runner, run in one contract mode; named after the mode so ``pair_ratios`` can compare modes."""

    def __init__(self, inner: Runner, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown contract mode {mode!r}; expected one of {', '.join(MODES)}")
        self.inner = inner
        self.mode = mode
        self.name = mode
        self.check_fractions: list[float] = []
        self.check_calls = 0

    def supports(self, batch_size: int, spec: RunSpec) -> bool:
        return self.inner.supports(batch_size, spec)

    def run(self, batch: Batch, spec: RunSpec, repeat: int) -> RunRecord:
        timer = CheckTimer()
        with contract_mode(self.mode, timer):
            record = self.inner.run(batch, spec, repeat)
        record.runner = self.name
        if self.mode in ("shapes", "full") and record.wall_s > 0:
            self.check_fractions.append(timer.seconds / record.wall_s)
            self.check_calls += timer.calls
        return record
