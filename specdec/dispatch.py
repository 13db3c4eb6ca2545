"""Capture-size dispatch: from the real batch to the descriptor that runs.

Mirrors how production engines choose a CUDA graph: a FULL graph (whole step
captured, requests padded too) needs a uniform batch whose padded token count is
a capture size divisible by the query length; otherwise a PIECEWISE graph pads
tokens only; a batch larger than every capture size runs eager.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator

from contracts import BatchExecutionDescriptor, CUDAGraphMode


class CaptureConfig(BaseModel):
    """Which graphs were captured. ``mode`` is the best one allowed.

    ``FULL`` means FULL for uniform batches and PIECEWISE for the rest (vLLM's
    FULL_AND_PIECEWISE), which is what production configurations run.
    """

    model_config = ConfigDict(frozen=True)

    mode: CUDAGraphMode = CUDAGraphMode.NONE
    capture_sizes: tuple[int, ...] = ()

    @field_validator("capture_sizes")
    @classmethod
    def _sorted_positive(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if any(s <= 0 for s in sizes):
            raise ValueError(f"capture sizes must be positive token counts, got {list(sizes)}")
        return tuple(sorted(set(sizes)))

    def bucket(self, num_tokens: int, multiple_of: int = 1) -> int | None:
        """Smallest capture size >= ``num_tokens`` divisible by ``multiple_of``."""
        for size in self.capture_sizes:
            if size >= num_tokens and size % multiple_of == 0:
                return size
        return None


def dispatch(
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    config: CaptureConfig,
    *,
    min_num_tokens: int = 0,
    max_mode: CUDAGraphMode = CUDAGraphMode.FULL,
    allow_piecewise: bool = True,
) -> BatchExecutionDescriptor:
    """The descriptor for ``num_reqs`` requests with ``num_tokens`` real tokens.

    ``min_num_tokens`` is the DP maximum when re-dispatching after a sync, so
    every rank pads to the same count; ``max_mode`` caps the mode (the DP-synced
    one); ``allow_piecewise=False`` is for steps that cannot run piecewise (one
    query per request draft decode, AR-3), which fall back to eager instead.
    """
    if num_reqs < 0 or num_tokens < 0:
        raise ValueError(f"dispatch needs non-negative counts, got num_reqs={num_reqs}, num_tokens={num_tokens}")
    if uniform_token_count is not None and num_reqs and num_tokens != num_reqs * uniform_token_count:
        raise ValueError(
            f"uniform_token_count={uniform_token_count} needs num_tokens == num_reqs * u, "
            f"got num_reqs={num_reqs}, num_tokens={num_tokens}"
        )
    target = max(num_tokens, min_num_tokens)
    mode = min(config.mode, max_mode)
    eager = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=target, num_reqs=num_reqs, uniform_token_count=uniform_token_count
    )
    if target == 0 or mode is CUDAGraphMode.NONE:
        return eager
    if mode is CUDAGraphMode.FULL and uniform_token_count is not None:
        size = config.bucket(target, multiple_of=uniform_token_count)
        if size is not None:
            return BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.FULL,
                num_tokens=size,
                num_reqs=size // uniform_token_count,
                uniform_token_count=uniform_token_count,
            )
    if allow_piecewise:
        size = config.bucket(target)
        if size is not None:
            return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=size)
    return eager
