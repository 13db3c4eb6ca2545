"""Run a function on N real ``torch.distributed`` (gloo) ranks on loopback, never hanging.

Each rank is a spawned process with a bounded collective timeout; the parent
waits with its own deadline and kills stragglers, so a rank that skips a
collective fails the caller with the rank's own error instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

from specdec.dp_group import TorchDistributedDPGroup, init_torch_distributed


class DistributedRunError(RuntimeError):
    """One or more ranks failed; ``errors`` maps rank to the exception it raised."""

    def __init__(self, message: str, errors: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


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
    out: Any,
) -> None:
    import torch.distributed as dist

    import contracts

    contracts.set_mode(contract_mode)
    try:
        group = init_torch_distributed(rank, size, f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
        result = fn(group, *args)
        out.put((rank, True, result))
    except BaseException as exc:
        try:
            out.put((rank, False, exc))
        except Exception:  # an unpicklable error still reaches the parent as text
            out.put((rank, False, RuntimeError(traceback.format_exc())))
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

    mode = contract_mode or contracts.current_mode().value
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, size, port, timeout_s, mode, fn, args, out), daemon=True)
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    try:
        for _ in range(size):
            rank, ok, value = out.get(timeout=deadline_s)
            (results if ok else errors)[rank] = value
    except queue.Empty:
        missing = sorted(set(range(size)) - set(results) - set(errors))
        errors.update({r: TimeoutError(f"rank {r} reported nothing within {deadline_s}s") for r in missing})
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        from specdec.dp_group import DPCollectiveTimeout

        ordered = sorted(errors.items(), key=lambda kv: (isinstance(kv[1], DPCollectiveTimeout), kv[0]))
        summary = "; ".join(f"rank {r}: {type(e).__name__}: {str(e).splitlines()[0]}" for r, e in ordered)
        raise DistributedRunError(f"{len(errors)} of {size} gloo ranks failed: {summary}", dict(ordered))
    return [results[r] for r in range(size)]
