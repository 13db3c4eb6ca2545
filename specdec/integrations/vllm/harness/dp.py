"""In-process DP ranks for vLLM's DP sync: one thread per rank and a host all-reduce between them.

vLLM's sync reduces a small host tensor over the DP group's CPU (gloo) group;
this group sums the ranks' tensors the same way. A rank that runs a collective
its peers never reach times out with a named error instead of hanging the run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class CollectiveMismatch(RuntimeError):
    """Ranks disagreed on running a collective: on real hardware this step would hang."""


class InProcessDPGroup:
    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(size)
        self._inputs: list[torch.Tensor | None] = [None] * size
        self._local = threading.local()
        self.collectives = [0] * size

    @property
    def rank(self) -> int:
        return int(self._local.rank)

    def all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        rank = self.rank
        self._inputs[rank] = tensor.clone()
        self.collectives[rank] += 1
        try:
            self._barrier.wait(self.timeout_s)
            total = torch.stack([t for t in self._inputs if t is not None]).sum(dim=0)
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CollectiveMismatch(
                f"DP rank {rank} was left alone in all_reduce #{self.collectives[rank]} (a peer failed, or never "
                f"reached it within {self.timeout_s:.0f} s); collectives run per rank: {self.collectives}"
            ) from None
        tensor.copy_(total.to(tensor.dtype))

    def torch_distributed(self) -> Any:
        """What ``dp_utils`` uses of ``torch.distributed``."""
        return SimpleNamespace(all_reduce=self.all_reduce)

    def dp_group(self) -> Any:
        """vLLM's DP group coordinator: its CPU group (to 0.32) or its own in-place host all-reduce (0.33 on)."""
        return SimpleNamespace(
            cpu_group=self, world_size=self.size, rank_in_group=None, cpu_all_reduce_=self.all_reduce
        )

    def run(self, body: Callable[[int], T]) -> list[T | BaseException]:
        """Run ``body(rank)`` on every rank at once; each rank's result or exception, in rank order."""
        results: list[T | BaseException] = [RuntimeError("rank did not finish")] * self.size

        def target(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = body(rank)
            except BaseException as exc:  # a rank's failure is its result
                results[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"dp-rank-{r}") for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results
