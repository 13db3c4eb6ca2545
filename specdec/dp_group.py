"""Data-parallel process groups: in-process ranks (threads) and torch.distributed.

Both count their collectives, so the DP sync can prove that every rank has run
the same number (DP-3), and both turn a peer that never arrives into a
``DPCollectiveTimeout`` instead of a hang.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from jaxtyping import Int, Shaped
from torch import Tensor

DEFAULT_TIMEOUT_S = 30.0
T = TypeVar("T")


class DPCollectiveTimeout(RuntimeError):
    """A peer did not join a collective in time: it skipped one, died or hangs."""


class DPRankStuck(DPCollectiveTimeout):
    """A rank still ran after its peers had failed or timed out, past the grace period: it hangs outside a collective."""


def validate_timeout(name: str, value: object) -> float:
    """``value`` as a positive, finite number of seconds, or a ``ValueError`` that names ``name``.

    A zero or negative timeout would fail every collective at once, and an
    infinite one would turn a missing peer back into a hang.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


@runtime_checkable
class DPGroup(Protocol):
    """What the runtime needs from a DP group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def collectives_run(self) -> int:
        """Collectives this rank has entered so far (the DP-3 counter)."""
        ...

    def all_gather_rows(self, row: Int[Tensor, " n"], *, name: str) -> Int[Tensor, "dp_size n"]:
        """Every rank's ``row``, stacked by rank; one collective."""
        ...

    def all_gather_equal(self, x: Shaped[Tensor, rows * rest], *, name: str) -> Shaped[Tensor, dp_rows * rest]:
        """Concatenate equal-size tensors from every rank (expert-parallel dispatch)."""
        ...


class _Rendezvous:
    """Shared state of one in-process world: a slot per rank, released by generation."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = validate_timeout("timeout_s", timeout_s)
        self.cond = threading.Condition()
        self.generation = 0
        self.arrived: dict[int, tuple[str, int, Tensor]] = {}
        self.results: dict[int, list[tuple[str, int, Tensor]]] = {}
        self.unread: dict[int, int] = {}
        self.seqs = [0] * size
        self.failed: str | None = None
        self.doing = ["not in a collective yet"] * size
        """What each rank did last, in words: how a rank stuck outside a collective is reported."""

    def exchange(self, rank: int, name: str, seq: int, value: Tensor) -> list[tuple[str, int, Tensor]]:
        self.doing[rank] = f"waiting in collective #{seq} ({name!r})"
        gathered = self._exchange(rank, name, seq, value)
        self.doing[rank] = f"running after collective #{seq} ({name!r}) returned"
        return gathered

    def _exchange(self, rank: int, name: str, seq: int, value: Tensor) -> list[tuple[str, int, Tensor]]:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            if self.failed is not None:
                raise DPCollectiveTimeout(self.failed)
            generation = self.generation
            self.seqs[rank] = seq
            self.arrived[rank] = (name, seq, value)
            if len(self.arrived) == self.size:
                self.results[generation] = [self.arrived[r] for r in range(self.size)]
                self.unread[generation] = self.size
                self.arrived = {}
                self.generation += 1
                self.cond.notify_all()
            while generation not in self.results:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.failed is not None:
                    missing = sorted(set(range(self.size)) - set(self.arrived))
                    message = self.failed or (
                        f"DP rank {rank} waited {self.timeout_s:.1f}s in collective #{seq} ({name!r}); "
                        f"ranks {missing} never joined (collective counters per rank: {self.seqs}). "
                        "A rank skipped a collective that its peers ran (DP-3)."
                    )
                    self.failed = message
                    self.cond.notify_all()
                    raise DPCollectiveTimeout(message)
                self.cond.wait(remaining)
            gathered = self.results[generation]
            self.unread[generation] -= 1
            if self.unread[generation] == 0:
                del self.results[generation], self.unread[generation]
            return gathered


class InProcessDPGroup:
    """One rank of an in-process DP world; ranks are threads sharing a rendezvous."""

    def __init__(self, rendezvous: _Rendezvous, rank: int) -> None:
        self._rv = rendezvous
        self._rank = rank
        self._seq = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._rv.size

    @property
    def collectives_run(self) -> int:
        return self._seq

    def _exchange(self, name: str, value: Tensor) -> list[tuple[str, int, Tensor]]:
        self._seq += 1
        return self._rv.exchange(self._rank, name, self._seq, value)

    def all_gather_rows(self, row: Int[Tensor, " n"], *, name: str) -> Int[Tensor, "dp_size n"]:
        gathered = self._exchange(name, row.detach().clone())
        return torch.stack([value for _, _, value in gathered])

    def all_gather_equal(self, x: Shaped[Tensor, rows * rest], *, name: str) -> Shaped[Tensor, dp_rows * rest]:
        gathered = self._exchange(name, x.detach().clone())
        shapes = {tuple(value.shape) for _, _, value in gathered}
        if len(shapes) != 1:
            raise RuntimeError(
                f"all_gather_equal {name!r}: ranks passed different shapes {[tuple(v.shape) for _, _, v in gathered]}; "
                "an equal-size collective needs every rank padded to the same token count"
            )
        return torch.cat([value for _, _, value in gathered])


def in_process_world(size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[InProcessDPGroup]:
    """``size`` groups, one per rank, sharing one rendezvous."""
    if size < 1:
        raise ValueError(f"a DP world needs at least one rank, got {size}")
    rendezvous = _Rendezvous(size, timeout_s)
    return [InProcessDPGroup(rendezvous, rank) for rank in range(size)]


def run_ranks(
    fn: Callable[[InProcessDPGroup], T], groups: Sequence[InProcessDPGroup], *, grace_s: float | None = None
) -> list[T]:
    """Run ``fn`` on every rank in its own thread; re-raise the first rank's error.

    Errors are ranked so that the root cause wins: a contract violation or other
    failure on some rank is raised in preference to the timeouts it caused in its
    peers. Every wait is bounded: once a rank has failed, the others have
    ``grace_s`` (default: the world's collective timeout) to finish; a rank still
    running then hangs outside a collective (no collective timeout can reach it),
    and is reported as ``DPRankStuck`` with its number, what it did last and the
    line it is running. Rank threads are daemons, so a stuck one never keeps the
    process alive.
    """
    if not groups:
        return []
    rv = groups[0]._rv
    grace = validate_timeout("grace_s", grace_s if grace_s is not None else rv.timeout_s)
    results: list[Any] = [None] * len(groups)
    errors: list[BaseException | None] = [None] * len(groups)
    finished = threading.Condition()
    first_failure: list[float] = []

    def work(i: int) -> None:
        try:
            results[i] = fn(groups[i])
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[i] = exc
            with rv.cond:
                if rv.failed is None:
                    rv.failed = f"DP rank {i} failed: {type(exc).__name__}: {exc}"
                rv.cond.notify_all()
        finally:
            with finished:
                if errors[i] is not None and not first_failure:
                    first_failure.append(time.monotonic())
                finished.notify_all()

    threads = [threading.Thread(target=work, args=(i,), daemon=True, name=f"dp-rank-{i}") for i in range(len(groups))]
    for t in threads:
        t.start()
    with finished:
        while any(t.is_alive() for t in threads):
            if first_failure and time.monotonic() - first_failure[0] >= grace:
                break
            wait = grace - (time.monotonic() - first_failure[0]) if first_failure else None
            finished.wait(timeout=min(wait, 1.0) if wait is not None else 1.0)
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    root = [e for e in errors if e is not None and not isinstance(e, DPCollectiveTimeout)]
    timeouts = [e for e in errors if e is not None]
    if stuck:
        report = DPRankStuck(_stuck_report(stuck, threads, rv, errors, grace))
        if root:
            root[0].add_note(str(report))
            raise root[0]
        raise report from (timeouts[0] if timeouts else None)
    if root or timeouts:
        raise (root or timeouts)[0]
    return list(results)


def _stuck_report(
    stuck: list[int], threads: list[threading.Thread], rv: _Rendezvous, errors: list[BaseException | None], grace: float
) -> str:
    failed = [i for i, e in enumerate(errors) if e is not None]
    first = next(e for e in errors if e is not None)
    lines = [
        f"DP rank(s) {stuck} still running {grace:.1f}s after rank(s) {failed} failed "
        f"({type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}); "
        "a rank blocked outside a collective, which no collective timeout can end:"
    ]
    frames = sys._current_frames()
    for i in stuck:
        frame = frames.get(threads[i].ident or -1)
        while frame is not None and frame.f_back is not None and frame.f_code.co_filename == threading.__file__:
            frame = frame.f_back  # a wait inside ``threading``: the caller's line is the one to read
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "unknown"
        lines.append(f"  rank {i}: last {rv.doing[i]}; now at {where}")
    return "\n".join(lines)


class TorchDistributedDPGroup:
    """A DP group over an initialised ``torch.distributed`` process group (gloo or NCCL)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_torch_distributed first")
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._seq = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def collectives_run(self) -> int:
        return self._seq

    def _guard(self, name: str, op: Callable[[], None]) -> None:
        self._seq += 1
        try:
            op()
        except RuntimeError as exc:
            raise DPCollectiveTimeout(
                f"DP rank {self._rank} failed in collective #{self._seq} ({name!r}): {exc}. "
                "A peer skipped a collective that this rank ran (DP-3), or died."
            ) from exc

    def all_gather_rows(self, row: Int[Tensor, " n"], *, name: str) -> Int[Tensor, "dp_size n"]:
        table = torch.zeros((self._size, row.shape[0]), dtype=row.dtype, device=row.device)
        table[self._rank] = row
        self._guard(name, lambda: self._dist.all_reduce(table, group=self._group))
        return table

    def all_gather_equal(self, x: Shaped[Tensor, rows * rest], *, name: str) -> Shaped[Tensor, dp_rows * rest]:
        parts = [torch.empty_like(x) for _ in range(self._size)]
        self._guard(name, lambda: self._dist.all_gather(parts, x.contiguous(), group=self._group))
        return torch.cat(parts)


def init_torch_distributed(
    rank: int, size: int, init_method: str, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
) -> TorchDistributedDPGroup:
    """Initialise the default process group with a bounded collective timeout."""
    import torch.distributed as dist

    timeout_s = validate_timeout("timeout_s", timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    return TorchDistributedDPGroup()
