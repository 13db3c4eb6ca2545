"""DESC-*: valid descriptors pass; each broken one raises the right invariant ID."""

from __future__ import annotations

import pytest
from hypothesis import given
from pydantic import ValidationError

from contracts import (
    BatchExecutionDescriptor,
    ContractViolation,
    CUDAGraphMode,
    DescriptorFacts,
    DPSyncState,
    StepKind,
    Subject,
    check,
)
from specdec.testing import BrokenDescriptorCase, DescriptorCase, invalid_descriptors, valid_descriptors


def _check(case: DescriptorCase) -> None:
    facts = DescriptorFacts(case.desc, case.num_reqs, case.num_tokens, case.all_ranks_idle)
    check(Subject.DESCRIPTOR, facts, step_kind=StepKind.TARGET, component="test")


@given(valid_descriptors())
def test_valid_descriptors_pass_every_desc_invariant(case: DescriptorCase) -> None:
    _check(case)
    assert case.desc.num_reqs_padded(case.num_reqs) >= case.num_reqs


@given(invalid_descriptors())
def test_each_broken_descriptor_names_its_invariant(broken: BrokenDescriptorCase) -> None:
    with pytest.raises(ContractViolation) as info:
        _check(broken.build())
    assert info.value.invariant_id == broken.expected_id, broken.description


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"cg_mode": CUDAGraphMode.PIECEWISE, "num_tokens": 8, "num_reqs": 8}, "DESC-1"),
        ({"cg_mode": CUDAGraphMode.FULL, "num_tokens": 8}, "DESC-2"),
        ({"cg_mode": CUDAGraphMode.NONE, "num_tokens": 8}, "DESC-3"),
        ({"cg_mode": CUDAGraphMode.FULL, "num_tokens": 9, "num_reqs": 4, "uniform_token_count": 2}, "DESC-4"),
        ({"cg_mode": CUDAGraphMode.NONE, "num_tokens": -1, "num_reqs": 0}, "DESC-6"),
    ],
)
def test_intrinsic_invariants_hold_in_every_mode(kwargs: dict[str, object], expected: str) -> None:
    import contracts

    with contracts.enforce("off"), pytest.raises(ContractViolation) as info:
        BatchExecutionDescriptor.model_validate(kwargs)
    assert info.value.invariant_id == expected
    assert info.value.component == "BatchExecutionDescriptor"


def test_violation_message_names_everything_an_operator_needs() -> None:
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=4, num_reqs=4)
    with pytest.raises(ContractViolation) as info:
        check(Subject.DESCRIPTOR, DescriptorFacts(desc, 4, 6), step_kind=StepKind.TARGET, component="engine")
    text = str(info.value)
    for part in (
        "[DESC-5]",
        "num_tokens >= the real token count",
        "real num_tokens",
        "descriptor:",
        "step kind: target",
        "component: engine",
        "likely cause:",
    ):
        assert part in text


def test_descriptor_is_frozen_and_typed() -> None:
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=4, num_reqs=4)
    with pytest.raises(ValidationError):
        desc.num_tokens = 5  # type: ignore[misc]
    with pytest.raises(ValidationError):
        BatchExecutionDescriptor.model_validate({"cg_mode": CUDAGraphMode.NONE, "num_tokens": "many", "num_reqs": 1})


def test_dp_state_with_wrong_entry_count_is_dp_1() -> None:
    with pytest.raises(ContractViolation) as info:
        DPSyncState(dp_size=4, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(1, 2, 3))
    assert info.value.invariant_id == "DP-1"


def test_violation_survives_pickling_across_processes() -> None:
    import pickle

    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=4, num_reqs=4)
    with pytest.raises(ContractViolation) as info:
        check(Subject.DESCRIPTOR, DescriptorFacts(desc, 4, 6), step_kind=StepKind.TARGET, component="engine")
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.invariant_id == "DESC-5" and "component: engine" in str(copy)
