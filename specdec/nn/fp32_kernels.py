"""Which fp32 kernel multiplies faster on this host, timed on the loaded model's own products.

A decode step multiplies one row per request by every weight of the model,
and a verify step 1 + K rows. Which kernel does that faster depends on the CPU,
and by a lot: on an AVX2 and an AMD AVX-512 host oneDNN's packed fp32 path won
at every such size, while on an Intel host with AMX MKL's ``F.linear`` took
0.73x its time at one to three rows and 1.2x from four (a one-row decode step
41.4 ms packed, 31.9 ms with MKL). So ``load`` times both on the model it
loaded: one pass over every decode product of the model (the real weights, in
forward order, so they stream from memory as in a forward) per kernel and row
count, the kernels alternating, the fastest of ``PASSES`` (a shared host only
ever adds time to a pass; a median of three flipped a clear 0.8x win in one
process of four, the fastest kept the same choice in six of six). Row counts
go up from 1 until the packed path wins twice in a row (MKL's cost grows with
the rows where the packed path's stays nearly flat) or ``MAX_ROWS``; where
``F.linear`` takes at most ``MARGIN`` of the packed time, fp32 products of that
row count take it (``specdec.nn.packed_linear.set_fp32_f_linear_rows``), in
every model of the process. A narrower win could flip between processes on a
shared host's noise and change logits' last bits from one run to the next.

A prefill's products are timed once more, at ``FP32_PREFILL_CHUNK`` rows (the
pieces a prefill is multiplied in), on the first decoder layer's products
repeated ``PREFILL_REPEATS`` times (``Transformer.prefill_products``); where
``F.linear`` wins there by the same margin, every fp32 prefill takes it. On
the AVX2 host the packed path took 0.86-0.90x MKL's time at 256 rows, and
a prompt's whole prefill 0.82x.

A timing taken while another job competes for the cores is not used
(``specdec.cpu_wait``): where the threads waited for a CPU more than
``MAX_CPU_WAIT`` of the time, the row counts are timed again, and where the
host is still busy every product keeps the packed path, the default of a model
nobody timed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.cpu_wait import CpuWait
from specdec.nn.packed_linear import (
    FP32_PREFILL_CHUNK,
    PackedLinear,
    mkldnn_available,
    packed_product,
    set_fp32_f_linear_rows,
)
from specdec.nn.transformer import Transformer

MAX_ROWS = 8
"""Row counts timed at most: decodes and the verifies of up to K = 7 drafts at batch 1."""
MARGIN = 0.9
"""``F.linear`` replaces the packed path at a row count only where it takes at most this share of its time."""
PASSES = 3
"""Timed passes per kernel and row count, after one that warms both up."""
MAX_CPU_WAIT = 0.05
"""A row count's timing whose threads waited for a CPU more than this share of their time was taken on a busy host.

Idle, the share reads 0.00-0.01; beside another two-thread job on two cores,
0.5. The packed kernel's one-row product suffers far more than ``F.linear``'s
from that (40x against 1.15x its quiet time, measured on two AMD EPYC cores)."""
PREFILL_REPEATS = 4
"""The prefill timing's pass multiplies one layer's products this many times: ~45 ms a pass on two AVX2 cores
(one layer once, ~11 ms, read 0.73-0.95x between passes where the whole model read 0.77-0.89x)."""
ATTEMPTS = 2
"""Timings of the row counts at most, when the first was taken on a busy host."""

Products = Sequence[tuple[PackedLinear, tuple[Tensor, ...]]]


@dataclass(frozen=True)
class KernelTiming:
    """One row count's pass over the model's decode products, per kernel (fastest pass, seconds)."""

    rows: int
    packed_s: float
    f_linear_s: float
    cpu_wait: float | None = None
    """The share of the threads' time spent waiting for a CPU while both were timed (``None``: not known)."""

    @property
    def f_linear_wins(self) -> bool:
        return self.f_linear_s <= MARGIN * self.packed_s

    @property
    def busy_host(self) -> bool:
        """Timed while another job took the cores: the figures say nothing about the kernels."""
        return self.cpu_wait is not None and self.cpu_wait > MAX_CPU_WAIT


def timed_on_busy_host(timings: Sequence[KernelTiming]) -> bool:
    """Whether any row count of a timing was taken on a busy host: then none of it is used or kept."""
    return any(t.busy_host for t in timings)


def timed_products(model: Transformer) -> Products:
    """The decode products whose kernel is chosen: none for a non-fp32 model, without oneDNN, or where no product
    takes the packed path (the test matrix's tiny models)."""
    return _packing(model, model.decode_products())


def timed_prefill_products(model: Transformer) -> Products:
    """The products a prefill's kernel is timed on (one layer's; none where ``timed_products`` finds none)."""
    return _packing(model, model.prefill_products())


def _packing(model: Transformer, products: Products) -> Products:
    if model.dtype != torch.float32 or not mkldnn_available():
        return []
    return [(linear, ws) for linear, ws in products if PackedLinear.packs(ws)]


def product_shapes(products: Products) -> list[list[int]]:
    """Each product's weight shapes, in order: what the timings depend on besides the host."""
    return [[int(d) for w in ws for d in w.shape] for _, ws in products]


def choose_fp32_kernels(model: Transformer) -> list[KernelTiming]:
    """Time both kernels on ``model`` and send the row counts where ``F.linear`` wins to it; returns the timings.

    The decode row counts come first, then one at ``FP32_PREFILL_CHUNK`` rows
    that stands for every prefill. Timings taken on a busy host
    (``KernelTiming.busy_host``) are taken again, up to ``ATTEMPTS`` in all; if
    the last are still busy, none of their wins count and every product keeps
    the packed path. Nothing is timed (and nothing changes) where
    ``timed_products`` finds none.
    """
    products = timed_products(model)
    if not products:
        return []
    prefill = timed_prefill_products(model)
    for _ in range(ATTEMPTS):
        timings = time_row_counts(products)
        if prefill:
            with torch.inference_mode():
                timings.append(time_kernels(list(prefill) * PREFILL_REPEATS, FP32_PREFILL_CHUNK))
        if not timed_on_busy_host(timings):
            set_fp32_f_linear_rows(frozenset(t.rows for t in timings if t.f_linear_wins))
            return timings
    set_fp32_f_linear_rows(frozenset())
    return timings


def time_row_counts(products: Products) -> list[KernelTiming]:
    """Row counts from 1 up, until the packed path wins twice in a row or ``MAX_ROWS``."""
    timings: list[KernelTiming] = []
    with torch.inference_mode():
        for rows in range(1, MAX_ROWS + 1):
            timings.append(time_kernels(products, rows))
            if len(timings) >= 2 and not (timings[-1].f_linear_wins or timings[-2].f_linear_wins):
                break
    return timings


def time_kernels(products: Products, rows: int) -> KernelTiming:
    """The fastest pass of each kernel over ``products`` at ``rows`` rows, the kernels alternating."""
    g = torch.Generator().manual_seed(rows)
    inputs = {n: torch.randn(rows, n, generator=g) for n in {ws[0].shape[1] for _, ws in products}}
    packed = [(linear.packed(ws), ws[0].shape[1]) for linear, ws in products]

    def packed_pass() -> None:
        for matrix, width in packed:
            packed_product(inputs[width], matrix)

    def f_linear_pass() -> None:
        for _, ws in products:
            x = inputs[ws[0].shape[1]]
            for w in ws:
                F.linear(x, w)

    times: dict[str, list[float]] = {"packed": [], "f_linear": []}
    with CpuWait() as wait:
        for i in range(PASSES + 1):
            order = [("packed", packed_pass), ("f_linear", f_linear_pass)]
            for name, run in order if i % 2 else order[::-1]:
                start = time.perf_counter()
                run()
                if i:
                    times[name].append(time.perf_counter() - start)
    return KernelTiming(rows, min(times["packed"]), min(times["f_linear"]), wait.share)
