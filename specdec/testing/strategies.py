"""Hypothesis strategies for step configurations, valid by construction or broken on purpose.

``st.builds`` on the pydantic models would ignore their cross-field validators,
so every strategy here is an ``@st.composite`` that constructs what a real
engine would construct. Backend authors reuse them to drive a drafter through
the configurations where padding bugs live: DP sizes 1/2/4/8, uneven and idle
ranks, every graph mode with arbitrary capture sizes, mixed prefill and decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import no_type_check

from hypothesis import strategies as st

from contracts import BatchExecutionDescriptor, CUDAGraphMode
from specdec.dispatch import CaptureConfig

DP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class RankBatch:
    """One rank's real batch: a query length per scheduled request (empty = idle)."""

    query_lens: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def uniform_token_count(self) -> int | None:
        lens = set(self.query_lens)
        return lens.pop() if len(lens) == 1 else None


@dataclass(frozen=True)
class StepConfig:
    """A whole DP step: the capture configuration and every rank's batch."""

    capture: CaptureConfig
    ranks: tuple[RankBatch, ...]

    @property
    def dp_size(self) -> int:
        return len(self.ranks)


@st.composite
@no_type_check
def capture_configs(draw: st.DrawFn, modes: tuple[CUDAGraphMode, ...] = tuple(CUDAGraphMode)) -> CaptureConfig:
    """A graph mode with capture sizes, from powers of two to odd one-offs."""
    mode = draw(st.sampled_from(modes))
    style = draw(st.sampled_from(["powers", "arbitrary", "none"]))
    if style == "powers":
        sizes = tuple(2**i for i in range(draw(st.integers(0, 7))))
    elif style == "arbitrary":
        sizes = tuple(draw(st.lists(st.integers(1, 160), min_size=1, max_size=8)))
    else:
        sizes = ()
    return CaptureConfig(mode=mode, capture_sizes=sizes)


@st.composite
@no_type_check
def rank_batches(
    draw: st.DrawFn,
    *,
    max_reqs: int = 16,
    max_query_len: int = 24,
    kind: str | None = None,
    allow_idle: bool = True,
) -> RankBatch:
    """One rank's batch: idle, uniform decode/verify (all q equal), or mixed prefill + decode."""
    kinds = ["uniform", "mixed"] + (["idle"] if allow_idle else [])
    chosen = kind or draw(st.sampled_from(kinds))
    if chosen == "idle":
        return RankBatch(())
    n = draw(st.integers(1, max_reqs))
    if chosen == "uniform":
        q = draw(st.integers(1, 9))
        return RankBatch((q,) * n)
    lens = draw(st.lists(st.one_of(st.just(1), st.integers(1, max_query_len)), min_size=n, max_size=n))
    return RankBatch(tuple(lens))


@st.composite
@no_type_check
def step_configs(
    draw: st.DrawFn,
    dp_sizes: tuple[int, ...] = DP_SIZES,
    *,
    uniform_q: int | None = None,
) -> StepConfig:
    """A DP step with uneven and idle ranks.

    ``uniform_q`` makes every busy rank a uniform batch of that query length
    (decode: 1, verify: K+1, block drafters: q) with its own request count.
    """
    dp_size = draw(st.sampled_from(dp_sizes))
    capture = draw(capture_configs())
    if uniform_q is not None:
        counts = draw(st.lists(st.integers(0, 16), min_size=dp_size, max_size=dp_size))
        ranks = tuple(RankBatch((uniform_q,) * n) for n in counts)
    else:
        ranks = tuple(draw(rank_batches()) for _ in range(dp_size))
    return StepConfig(capture=capture, ranks=ranks)


@dataclass(frozen=True)
class DescriptorCase:
    """A descriptor with the local counts it must be checked against."""

    desc: BatchExecutionDescriptor
    num_reqs: int
    num_tokens: int
    all_ranks_idle: bool | None = None


@st.composite
@no_type_check
def valid_descriptors(draw: st.DrawFn) -> DescriptorCase:
    """A descriptor that satisfies every DESC invariant for its local batch."""
    mode = draw(st.sampled_from(list(CUDAGraphMode)))
    num_reqs = draw(st.integers(0, 32))
    if mode is CUDAGraphMode.FULL:
        u = draw(st.integers(1, 9))
        padded = draw(st.integers(max(num_reqs, 1), num_reqs + 16))
        desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=padded * u, num_reqs=padded, uniform_token_count=u)
        return DescriptorCase(desc, num_reqs, num_reqs * u)
    if num_reqs == 0:
        tokens = 0
    else:
        tokens = draw(st.integers(num_reqs, num_reqs * 12))
    pad = draw(st.integers(0, 16)) if tokens else 0
    if mode is CUDAGraphMode.PIECEWISE:
        desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=tokens + max(pad, 1 if tokens == 0 else 0))
        return DescriptorCase(desc, num_reqs, tokens)
    desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=tokens + pad, num_reqs=num_reqs)
    return DescriptorCase(desc, num_reqs, tokens)


@dataclass(frozen=True)
class BrokenDescriptorCase:
    """A way to break a descriptor invariant, with the ID that must be reported."""

    expected_id: str
    build: Callable[[], DescriptorCase]
    description: str


@st.composite
@no_type_check
def invalid_descriptors(draw: st.DrawFn) -> BrokenDescriptorCase:
    """A descriptor (or its local counts) broken so that exactly one DESC invariant fails first."""
    full, piecewise, none = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
    n = draw(st.integers(1, 24))
    u = draw(st.integers(1, 8))
    extra = draw(st.integers(1, 8))
    choice = draw(
        st.sampled_from(
            [
                "DESC-1a",
                "DESC-1b",
                "DESC-2a",
                "DESC-2b",
                "DESC-3a",
                "DESC-3b",
                "DESC-4",
                "DESC-5a",
                "DESC-5b",
                "DESC-6a",
                "DESC-6b",
            ]
        )
    )

    def case(
        desc_kwargs: dict[str, object], num_reqs: int, num_tokens: int, all_idle: bool | None = None
    ) -> Callable[[], DescriptorCase]:
        return lambda: DescriptorCase(
            BatchExecutionDescriptor.model_validate(desc_kwargs), num_reqs, num_tokens, all_idle
        )

    table: dict[str, tuple[str, Callable[[], DescriptorCase], str]] = {
        "DESC-1a": (
            "DESC-1",
            case({"cg_mode": piecewise, "num_tokens": n + extra, "num_reqs": n}, n, n),
            "piecewise with request padding",
        ),
        "DESC-1b": (
            "DESC-1",
            case({"cg_mode": piecewise, "num_tokens": n * u, "uniform_token_count": u}, n, n * u),
            "piecewise with a uniform shape",
        ),
        "DESC-2a": ("DESC-2", case({"cg_mode": full, "num_tokens": n * u}, n, n * u), "FULL without a request count"),
        "DESC-2b": (
            "DESC-2",
            case(
                {"cg_mode": full, "num_tokens": n * u, "num_reqs": n, "uniform_token_count": u},
                n + extra,
                (n + extra) * u,
            ),
            "FULL padded below the local request count",
        ),
        "DESC-3a": ("DESC-3", case({"cg_mode": none, "num_tokens": n}, n, n), "eager without a request count"),
        "DESC-3b": (
            "DESC-3",
            case({"cg_mode": none, "num_tokens": n + extra, "num_reqs": n + extra}, n, n),
            "eager with padded requests",
        ),
        "DESC-4": (
            "DESC-4",
            case({"cg_mode": full, "num_tokens": n * u + extra, "num_reqs": n, "uniform_token_count": u}, n, n * u),
            "FULL tokens not num_reqs * u",
        ),
        "DESC-5a": (
            "DESC-5",
            case({"cg_mode": none, "num_tokens": n, "num_reqs": n}, n, n + extra),
            "fewer tokens than the real batch",
        ),
        "DESC-5b": (
            "DESC-5",
            case({"cg_mode": none, "num_tokens": 0, "num_reqs": 0}, 0, 0, False),
            "zero tokens while a peer is busy",
        ),
        "DESC-6a": ("DESC-6", case({"cg_mode": none, "num_tokens": -n, "num_reqs": 0}, 0, 0), "negative token count"),
        "DESC-6b": (
            "DESC-6",
            case({"cg_mode": none, "num_tokens": n, "num_reqs": 1, "uniform_token_count": 0}, 1, n),
            "uniform count 0",
        ),
    }
    expected, build, description = table[choice]
    return BrokenDescriptorCase(expected, build, description)
