"""Run a function on N real ``torch.distributed`` (gloo) ranks on loopback, never hanging.

Each rank is a spawned process with a bounded collective timeout that reports
on its own pipe. The parent waits on those pipes and on the processes'
sentinels together, so a rank that dies without reporting (killed, crashed
interpreter) is named with its exit code or signal as soon as it is gone, not
at the deadline. Once any rank has failed, the others get the collective
timeout plus a margin to report; stragglers are then killed, so a rank that
skips a collective fails the caller with the rank's own error instead of
hanging CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from specdec.dp_group import DPCollectiveTimeout, TorchDistributedDPGroup, init_torch_distributed, validate_timeout

REPORT_MARGIN_S = 10.0
"""How long, past the collective timeout, the other ranks have to report once one rank failed."""


class DistributedRunError(RuntimeError):
    """One or more ranks failed; ``errors`` maps rank to the exception it raised."""

    def __init__(self, message: str, errors: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


class RankDied(RuntimeError):
    """A rank's process ended without reporting a result or an error: killed, or its interpreter crashed."""


def exit_description(exitcode: int | None) -> str:
    """A process's end in words: a negative exit code is the signal that killed it."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    contract_mode: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Connection,
) -> None:
    import torch.distributed as dist

    import contracts

    contracts.set_mode(contract_mode)
    try:
        group = init_torch_distributed(rank, size, f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
        result = fn(group, *args)
        out.send((True, result))
    except BaseException as exc:
        try:
            out.send((False, exc))
        except Exception:  # an unpicklable error still reaches the parent as text
            out.send((False, RuntimeError(traceback.format_exc())))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_gloo(
    size: int,
    fn: Callable[[TorchDistributedDPGroup], Any] | Callable[..., Any],
    *args: Any,
    timeout_s: float = 5.0,
    deadline_s: float = 120.0,
    contract_mode: str | None = None,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``size`` gloo ranks; return per-rank results.

    ``fn`` must be a module-level function (it is pickled into spawned
    processes). Raises ``DistributedRunError`` when a rank fails, with the
    root-cause errors (not the peers' resulting timeouts) first.
    """
    import contracts

    timeout_s = validate_timeout("timeout_s", timeout_s)
    deadline_s = validate_timeout("deadline_s", deadline_s)
    mode = contract_mode or contracts.current_mode().value
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
    procs = [
        ctx.Process(target=_rank_main, args=(rank, size, port, timeout_s, mode, fn, args, pipes[rank][1]), daemon=True)
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    for _, send in pipes:
        send.close()  # the child holds its own end: a dead child's pipe reads as closed, not as empty
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    try:
        _collect(procs, [recv for recv, _ in pipes], results, errors, timeout_s, deadline_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for recv, _ in pipes:
            recv.close()
    if errors:
        ordered = sorted(errors.items(), key=lambda kv: (isinstance(kv[1], (DPCollectiveTimeout, TimeoutError)), kv[0]))
        summary = "; ".join(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0]}" for r, e in ordered)
        raise DistributedRunError(f"{len(errors)} of {size} gloo ranks failed: {summary}", dict(ordered))
    return [results[r] for r in range(size)]


def _collect(
    procs: list[Any],
    pipes: list[Connection],
    results: dict[int, Any],
    errors: dict[int, BaseException],
    timeout_s: float,
    deadline_s: float,
) -> None:
    """Wait for every rank's report or death; bounded by the deadline, and by the collective timeout once one failed."""
    start = time.monotonic()
    deadline = start + deadline_s
    pending = set(range(len(procs)))
    first_failure: float | None = None
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure is None else min(deadline, first_failure + timeout_s + REPORT_MARGIN_S)
        if now >= limit:
            break
        waitables: list[Any] = [pipes[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(wait(waitables, timeout=limit - now))
        for r in sorted(pending):
            if pipes[r] in ready or procs[r].sentinel in ready:
                report = _read_report(r, pipes[r], procs[r])
                if report is None:
                    continue  # the sentinel fired before the pipe drained: read again next round
                ok, value = report
                (results if ok else errors)[r] = value
                pending.discard(r)
                if not ok and first_failure is None:
                    first_failure = time.monotonic()
    for r in sorted(pending):
        if first_failure is None:
            why = f"rank {r} reported nothing within the {deadline_s:g}s deadline"
        else:
            failed = sorted(errors)
            why = (
                f"rank {r} reported nothing {timeout_s + REPORT_MARGIN_S:g}s after rank(s) {failed} failed "
                f"(collective timeout {timeout_s:g}s): it hangs outside a collective; killed"
            )
        errors[r] = TimeoutError(why)


def _read_report(rank: int, pipe: Connection, proc: Any) -> tuple[bool, Any] | None:
    """The rank's (ok, value), a ``RankDied`` when its process ended silently, or ``None`` when not ready yet."""
    try:
        if pipe.poll():
            ok, value = pipe.recv()
            return bool(ok), value
    except (EOFError, OSError):
        pass  # the child's end closed with nothing in it: the process is gone
    proc.join(timeout=5)
    if proc.exitcode is None:
        return None
    return False, RankDied(f"rank {rank} {exit_description(proc.exitcode)} before reporting a result")
