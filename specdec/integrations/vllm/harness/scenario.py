"""One harness case and the matrix of them: method, DP ranks, graph mode, capture sizes, K, descriptor source.

Methods name vLLM's draft-step code paths, not only its named speculators: the hooks wrap methods that every
subclass inherits, so a subclass that runs them differently is a method of its own here. ``ar-gemma4`` is
Gemma4's MTP speculator, whose draft steps keep their positions (it builds attention once, at the first step);
``dspark-fill-in`` is DSpark with ``sample_from_anchor`` off, whose block is 1 + K queries (the anchor a bonus
token) where DSpark's default block is K; ``ar-standalone`` (0.34 on) is the standalone draft model, whose own
forward runs in the autoregressive loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from specdec.integrations.vllm.versions import ReleaseLayout

METHODS = ("ar-multi-step", "ar-fused", "ar-gemma4", "ar-standalone", "dflash", "dspark", "dspark-fill-in")
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

    ``step_k`` is the K of this step where it is below the configured ``k``:
    vLLM's dynamic speculation (a K per batch size, from 0.32 passed to the
    autoregressive decode loop) drafts fewer tokens than its buffers and graphs
    were sized for.
    """

    method: str
    reqs_per_rank: tuple[int, ...]
    graph_mode: str
    capture_sizes: tuple[int, ...]
    k: int
    source: str = "dispatch"
    max_num_seqs: int = 32
    step_k: int | None = None

    @property
    def dp_size(self) -> int:
        return len(self.reqs_per_rank)

    @property
    def query_width(self) -> int:
        """Queries per request in a draft step: one for the autoregressive loops, the block for DFlash and DSpark."""
        if self.method.startswith("ar"):
            return 1
        return self.k if self.method == "dspark" else self.k + 1

    def label(self) -> str:
        ranks = "/".join(str(n) for n in self.reqs_per_rank)
        sizes = ",".join(str(s) for s in self.capture_sizes) or "-"
        k = f"K={self.k}" if self.step_k is None else f"K={self.k} step K={self.step_k}"
        return f"{self.method} dp={self.dp_size} reqs={ranks} {self.graph_mode} capture=[{sizes}] {k} {self.source}"


def release_methods(layout: ReleaseLayout) -> tuple[str, ...]:
    """The methods a release has code for: ``ar-standalone`` from 0.34, every other one in all of them."""
    return tuple(m for m in METHODS if m != "ar-standalone" or layout.standalone_module is not None)


def matrix(layout: ReleaseLayout, methods: tuple[str, ...] | None = None, quick: bool = False) -> Iterator[Scenario]:
    """Every combination the harness runs on ``layout``'s release (``methods``: some of its own, default all);
    ``quick`` keeps one of each kind for a fast check.

    Where the release's decode loop takes the step's K (0.32 on), the two named autoregressive loops also run steps
    of K 2 under the largest configured K (Gemma4's and the standalone model's run the multi-step loop's code)."""
    dynamic_k = layout.decode_takes_k
    methods = release_methods(layout) if methods is None else methods
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
        if dynamic_k and method in ("ar-multi-step", "ar-fused") and k == max(ks):
            yield Scenario(method, ranks, mode, sizes, k, source, step_k=2)
