"""What actually runs on the device in one step, and the DP sync result it came from."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from contracts.violation import ContractViolation


class CUDAGraphMode(enum.IntEnum):
    """Ordered so that the DP sync can take the minimum: one eager rank makes all eager."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2


def _mode_name(mode: object) -> str:
    """The mode's name; a repr must not fail even on an object built past the validators."""
    name = getattr(mode, "name", None)
    return name if isinstance(name, str) else repr(mode)


def _as_list(counts: object) -> object:
    return list(counts) if isinstance(counts, (tuple, list)) else counts


class BatchExecutionDescriptor(BaseModel):
    """The padded shape of one forward pass.

    The validator enforces the invariants that need no outside facts (DESC-1,
    DESC-4 and non-negative counts) on every construction, whatever the
    enforcement mode: a value that breaks them is not a descriptor at all.
    Invariants that compare with the local, unpadded batch (DESC-2, DESC-3,
    DESC-5) are registry checks run at the step boundary.

    Counts are strict ints (a string, a bool or a 0-d tensor is refused, not
    coerced) and an unknown field is an error, so a misspelled ``num_req=`` is
    not silently dropped.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cg_mode: CUDAGraphMode
    num_tokens: StrictInt
    num_reqs: StrictInt | None = None
    uniform_token_count: StrictInt | None = None

    @model_validator(mode="after")
    def _intrinsic_invariants(self) -> BatchExecutionDescriptor:
        from contracts.invariants.descriptor import check_intrinsic

        check_intrinsic(self)
        return self

    def num_reqs_padded(self, num_reqs: int) -> int:
        """``desc.num_reqs or num_reqs``: the request rows this step has."""
        return self.num_reqs if self.num_reqs is not None else num_reqs

    def __repr__(self) -> str:
        return (
            f"BatchExecutionDescriptor(cg_mode={_mode_name(self.cg_mode)}, num_tokens={self.num_tokens}, "
            f"num_reqs={self.num_reqs}, uniform_token_count={self.uniform_token_count})"
        )


class DPSyncState(BaseModel):
    """The result of one DP sync; identical on every rank by construction (DP-3).

    ``num_tokens_across_dp`` holds the token count each rank runs: the common
    padded count unless every rank runs eager, in which case each rank keeps its
    own unpadded count, or every rank runs one common pad (a draft step whose
    collectives need equal rows; DP-2).

    Strict like the descriptor: strict ints, no unknown fields, ``dp_size >= 1``,
    non-negative counts, and under FULL one common count on every rank (DP-1;
    a PIECEWISE result with unequal counts is left to the registry's DP-1 check).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_size: StrictInt = Field(ge=1)
    cg_mode: CUDAGraphMode
    num_tokens_across_dp: tuple[Annotated[StrictInt, Field(ge=0)], ...]
    uniform_token_count: StrictInt | None = Field(default=None, ge=1)
    collective_seq: StrictInt = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _shape(self) -> DPSyncState:
        if len(self.num_tokens_across_dp) != self.dp_size:
            raise ContractViolation(
                "DP-1",
                "num_tokens_across_dp has dp_size entries",
                {
                    "dp_size": self.dp_size,
                    "len(num_tokens_across_dp)": len(self.num_tokens_across_dp),
                },
                component="DPSyncState",
            )
        if self.cg_mode is CUDAGraphMode.FULL and len(set(self.num_tokens_across_dp)) > 1:
            raise ContractViolation(
                "DP-1",
                "under FULL every rank runs the same padded token count (one captured graph size)",
                {"cg_mode": self.cg_mode.name, "num_tokens_across_dp": list(self.num_tokens_across_dp)},
                component="DPSyncState",
                likely_cause="a FULL sync kept each rank's own count instead of the DP maximum",
            )
        return self

    @property
    def all_idle(self) -> bool:
        return all(n == 0 for n in self.num_tokens_across_dp)

    @property
    def max_num_tokens(self) -> int:
        return max(self.num_tokens_across_dp, default=0)

    def __repr__(self) -> str:
        return (
            f"DPSyncState(dp_size={self.dp_size}, cg_mode={_mode_name(self.cg_mode)}, "
            f"num_tokens_across_dp={_as_list(self.num_tokens_across_dp)!r}, "
            f"uniform_token_count={self.uniform_token_count}, collective_seq={self.collective_seq})"
        )
