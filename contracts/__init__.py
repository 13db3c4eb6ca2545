"""Typed contracts of a speculative-decoding step: vocabulary, invariants, enforcement.

Imports nothing from ``specdec`` or ``backends``; importing it registers every
invariant so that the catalog is complete.
"""

from contracts import invariants as _invariants  # noqa: F401  (registers the catalog)
from contracts.descriptor import BatchExecutionDescriptor, CUDAGraphMode, DPSyncState
from contracts.enforcement import ENV_VAR, Mode, check, current_mode, enforce, set_mode
from contracts.evidence import (
    BlockEvidence,
    CapacityEvidence,
    ConfidenceEvidence,
    MarkovChainEvidence,
    ProposalSourceEvidence,
)
from contracts.facts import (
    BatchFacts,
    CacheFacts,
    DescriptorFacts,
    DPFacts,
    ForwardOutputFacts,
    HeadFacts,
    ProposalCountFacts,
    ProposalFacts,
    VerifierFacts,
)
from contracts.metadata import (
    PAD_SLOT_ID,
    REJECTED_TOKEN_ID,
    AttentionMetadata,
    RecoveryEvidence,
    VerifierInput,
    VerifierOutput,
)
from contracts.registry import REGISTRY, Invariant, StepKind, Subject, Tag, all_invariants
from contracts.violation import ContractViolation

__all__ = [
    "ENV_VAR",
    "PAD_SLOT_ID",
    "REGISTRY",
    "REJECTED_TOKEN_ID",
    "AttentionMetadata",
    "BatchExecutionDescriptor",
    "BatchFacts",
    "BlockEvidence",
    "CUDAGraphMode",
    "CacheFacts",
    "CapacityEvidence",
    "ConfidenceEvidence",
    "ContractViolation",
    "DPFacts",
    "DPSyncState",
    "DescriptorFacts",
    "ForwardOutputFacts",
    "HeadFacts",
    "Invariant",
    "MarkovChainEvidence",
    "Mode",
    "ProposalCountFacts",
    "ProposalFacts",
    "ProposalSourceEvidence",
    "RecoveryEvidence",
    "StepKind",
    "Subject",
    "Tag",
    "VerifierFacts",
    "VerifierInput",
    "VerifierOutput",
    "all_invariants",
    "check",
    "current_mode",
    "enforce",
    "set_mode",
]
