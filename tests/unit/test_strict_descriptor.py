"""Descriptors and DP sync results are strict: no coerced counts, no unknown fields, every count validated."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from contracts import ContractViolation
from contracts.descriptor import BatchExecutionDescriptor, CUDAGraphMode, DPSyncState


@pytest.mark.parametrize("count", ["4", True, torch.tensor(4), 4.0])
def test_a_count_that_is_not_an_int_is_refused(count: Any) -> None:
    with pytest.raises(ValidationError, match="num_tokens"):
        BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=count)
    with pytest.raises(ValidationError, match="num_reqs"):
        BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=4, num_reqs=count)


def test_a_misspelled_field_is_an_error_not_dropped() -> None:
    with pytest.raises(ValidationError, match=r"num_req\n.*Extra inputs are not permitted"):
        BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=4, num_req=4)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="dp_rank"):
        DPSyncState(dp_size=1, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(4,), dp_rank=0)  # type: ignore[call-arg]


def test_a_negative_descriptor_count_is_desc_6() -> None:
    with pytest.raises(ContractViolation) as info:
        BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=-1)
    assert info.value.invariant_id == "DESC-6"


def test_ints_in_the_right_form_still_build() -> None:
    desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, uniform_token_count=1)
    assert (desc.num_tokens, desc.num_reqs_padded(3)) == (8, 8)
    state = DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=[3, 5], collective_seq=4)
    assert state.num_tokens_across_dp == (3, 5) and state.max_num_tokens == 5
    assert DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.FULL, num_tokens_across_dp=(8, 8)).all_idle is False


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"dp_size": 0, "num_tokens_across_dp": ()}, "dp_size"),
        ({"dp_size": 2, "num_tokens_across_dp": (3, -1)}, "num_tokens_across_dp.1"),
        ({"dp_size": 1, "num_tokens_across_dp": (3,), "collective_seq": -1}, "collective_seq"),
        ({"dp_size": 1, "num_tokens_across_dp": (3,), "uniform_token_count": 0}, "uniform_token_count"),
        ({"dp_size": 1, "num_tokens_across_dp": ("3",)}, "num_tokens_across_dp.0"),
        ({"dp_size": True, "num_tokens_across_dp": (3,)}, "dp_size"),
    ],
)
def test_dp_state_counts_are_validated(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        DPSyncState(cg_mode=CUDAGraphMode.NONE, **fields)
    assert field in str(info.value)


def test_full_with_unequal_counts_across_ranks_is_dp_1() -> None:
    with pytest.raises(ContractViolation) as info:
        DPSyncState(dp_size=2, cg_mode=CUDAGraphMode.FULL, num_tokens_across_dp=(8, 16))
    assert info.value.invariant_id == "DP-1"
    assert info.value.observed == {"cg_mode": "FULL", "num_tokens_across_dp": [8, 16]}


def test_eager_ranks_keep_their_own_counts() -> None:
    state = DPSyncState(dp_size=3, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=(3, 0, 5))
    assert state.num_tokens_across_dp == (3, 0, 5)
