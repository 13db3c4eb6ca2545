"""One harness case and the matrix of them: method, DP ranks, graph mode, capture sizes, K, descriptor source."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

METHODS = ("ar-multi-step", "ar-fused", "dflash", "dspark")
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
SOURCES = ("dispatch", "dp-padded")


@dataclass(frozen=True)
class Scenario:
    """A draft step on every DP rank.

    ``reqs_per_rank[r] == 0`` is an idle rank, which vLLM runs as a dummy step
    with one request. ``source`` says where the draft step's descriptor comes
    from: ``dispatch`` is the release's own dispatch and DP sync;
    ``dp-padded`` is the shape a DP-padded eager step has (no graph for the
    agreed size: ``NONE`` with the largest rank's token count and the local
    request count), which releases from 0.30 produce whenever a rank reuses the
    target's DP agreement and no draft graph covers it.
    """

    method: str
    reqs_per_rank: tuple[int, ...]
    graph_mode: str
    capture_sizes: tuple[int, ...]
    k: int
    source: str = "dispatch"
    max_num_seqs: int = 32

    @property
    def dp_size(self) -> int:
        return len(self.reqs_per_rank)

    def label(self) -> str:
        ranks = "/".join(str(n) for n in self.reqs_per_rank)
        sizes = ",".join(str(s) for s in self.capture_sizes) or "-"
        return (
            f"{self.method} dp={self.dp_size} reqs={ranks} {self.graph_mode} capture=[{sizes}] K={self.k} {self.source}"
        )


def matrix(methods: tuple[str, ...] = METHODS, quick: bool = False) -> Iterator[Scenario]:
    """Every combination the harness runs; ``quick`` keeps one of each kind for a fast check."""
    rank_layouts: tuple[tuple[int, ...], ...] = ((1,), (12,), (12, 13), (3, 0), (5, 2, 0, 7))
    capture_sets: tuple[tuple[int, ...], ...] = ((1, 2, 4, 8, 16, 32), (1, 2, 4, 8))
    ks = (1, 3) if quick else (1, 2, 4)
    modes = ("NONE", "FULL_AND_PIECEWISE") if quick else GRAPH_MODES
    if quick:
        rank_layouts = ((12,), (12, 13), (3, 0))
        capture_sets = capture_sets[:1]
    for method, ranks, mode, sizes, k, source in itertools.product(
        methods, rank_layouts, modes, capture_sets, ks, SOURCES
    ):
        if source == "dp-padded" and (len(ranks) == 1 or len(set(ranks)) == 1):
            continue  # no rank is padded to another's count
        if method.startswith("ar") and k == 1:
            continue  # K=1 drafts in the prefill only; there is no draft decode step
        yield Scenario(method, ranks, mode, sizes, k, source)
