"""Micro-benchmark: what each contract mode costs at one step boundary.

Measures, for a realistic target batch (many requests, verify-shaped or mixed,
padded to a capture size), the median time to build the attention metadata and
the median time of the boundary checks in each mode, side by side in one run
so that the ratios are meaningful on a noisy machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import contracts
from contracts import BatchFacts, CUDAGraphMode, DescriptorFacts, StepKind, Subject
from specdec.attn_metadata import ScheduledRequest, build_positions, build_target_metadata, reserve
from specdec.dispatch import CaptureConfig, dispatch
from specdec.kv_cache import KVCacheManager


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(min(50, repeats)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000.0


def main(repeats: int = 2000, num_reqs: int = 64, query_len: int = 4) -> int:
    block_size = 16
    kv = KVCacheManager(num_blocks=num_reqs * 64, block_size=block_size)
    requests = [ScheduledRequest(f"r{i}", 100 + 7 * i, query_len) for i in range(num_reqs)]
    for r in requests:
        kv.add_request(r.req_id)
    reserve(requests, kv)
    capture = CaptureConfig(mode=CUDAGraphMode.FULL, capture_sizes=tuple(range(8, 1025, 8)))
    num_tokens = num_reqs * query_len
    desc = dispatch(num_reqs, num_tokens, query_len, capture)
    with contracts.enforce("off"):
        meta = build_target_metadata(requests, desc, kv)
        positions = build_positions(requests, desc)
    input_ids = torch.zeros(desc.num_tokens, dtype=torch.int64)
    facts = BatchFacts(desc, num_reqs, num_tokens, meta, input_ids, positions, block_size=block_size)
    dfacts = DescriptorFacts(desc, num_reqs, num_tokens)

    def boundary() -> None:
        contracts.check(Subject.DESCRIPTOR, dfacts, step_kind=StepKind.TARGET, component="bench")
        contracts.check(Subject.BATCH, facts, step_kind=StepKind.TARGET, component="bench")

    def build() -> None:
        build_target_metadata(requests, desc, kv)

    rows: list[tuple[str, float, float]] = []
    with contracts.enforce("off"):
        build_us = _median_us(build, max(200, repeats // 10))
        nothing_us = _median_us(lambda: None, repeats)
    for mode in ("off", "shapes", "full"):
        with contracts.enforce(mode):
            rows.append((mode, _median_us(boundary, repeats), build_us))

    print(
        f"contract cost per step boundary: {num_reqs} requests x {query_len} tokens = {num_tokens} tokens, "
        f"{desc!r}, median of {repeats} runs"
    )
    print(f"building the target attention metadata (contracts off): {build_us:9.1f} us")
    print(f"an empty call, for scale:                               {nothing_us:9.3f} us")
    print(f"{'mode':<8} {'checks (us)':>12} {'vs metadata build':>18}")
    for mode, cost, base in rows:
        print(f"{mode:<8} {cost:12.2f} {cost / base:17.1%}")
    print("'shapes' reads host mirrors and host tensors only; 'full' also reads device values (syncs on a GPU).")
    return 0
