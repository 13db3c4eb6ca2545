"""Public testing kit: Hypothesis strategies for step configurations (needs the ``testing`` extra)."""

from specdec.testing.strategies import (
    DP_SIZES,
    BrokenDescriptorCase,
    DescriptorCase,
    RankBatch,
    StepConfig,
    capture_configs,
    invalid_descriptors,
    rank_batches,
    step_configs,
    valid_descriptors,
)

__all__ = [
    "DP_SIZES",
    "BrokenDescriptorCase",
    "DescriptorCase",
    "RankBatch",
    "StepConfig",
    "capture_configs",
    "invalid_descriptors",
    "rank_batches",
    "step_configs",
    "valid_descriptors",
]
