"""Public testing kit (needs the ``testing`` extra).

- Step-level Hypothesis strategies: descriptors, capture configs, per-rank DP
  batches (``specdec.testing.strategies``).
- Whole-run strategies and runners: ``dp_run_specs``, ``run_in_process``, plain
  reference outputs (``specdec.testing.dp_run``), gloo processes
  (``specdec.testing.distributed``).
- The conformance suite for any backend: ``check_backend`` and its families
  (``specdec.testing.conformance``); the pytest plugin and ``specdec matrix``
  are built on it; ``ForcedAcceptance`` wraps any speculator to force an
  acceptance pattern (``specdec.testing.forced_acceptance``).
- The mutation corpus: ``specdec.testing.mutant`` (how a mutant is written),
  ``specdec.testing.corpus`` (the runtime's own mutants and every
  ``specdec.mutants`` entry point), ``specdec mutate`` (``specdec.testing.mutation``).
"""

from specdec.testing.conformance import (
    FAMILIES,
    TENSOR_MODES,
    ConformanceReport,
    FamilyResult,
    check_backend,
    family_cases,
    run_family,
)
from specdec.testing.dp_run import DPRunSpec, RequestSpec, dp_run_specs, plain_outputs, run_in_process
from specdec.testing.forced_acceptance import ForcedAcceptance
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
    "FAMILIES",
    "TENSOR_MODES",
    "BrokenDescriptorCase",
    "ConformanceReport",
    "DPRunSpec",
    "DescriptorCase",
    "FamilyResult",
    "ForcedAcceptance",
    "RankBatch",
    "RequestSpec",
    "StepConfig",
    "capture_configs",
    "check_backend",
    "dp_run_specs",
    "family_cases",
    "invalid_descriptors",
    "plain_outputs",
    "rank_batches",
    "run_family",
    "run_in_process",
    "step_configs",
    "valid_descriptors",
]
