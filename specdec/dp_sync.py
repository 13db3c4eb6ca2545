"""The DP sync of one step: one collective, then a descriptor every rank agrees on.

Each rank contributes ``[num_tokens, cg_mode, uniform_token_count, num_reqs,
collectives_run]``. All idle: nobody runs. Otherwise the minimum graph mode
wins (one eager rank makes every rank eager, each keeping its own unpadded
count; an idle rank then runs a one-token dummy step so that its peers'
collectives still line up); graph modes re-dispatch every rank with the DP
maximum, so all ranks run the same padded token count.
"""

from __future__ import annotations

import torch

from contracts import (
    BatchExecutionDescriptor,
    CUDAGraphMode,
    DescriptorFacts,
    DPFacts,
    DPSyncState,
    StepKind,
    Subject,
    check,
)
from contracts.invariants.dp import purpose_tag
from specdec.dispatch import CaptureConfig, dispatch
from specdec.dp_group import DPGroup

IDLE_DUMMY_TOKENS = 1
"""Tokens an idle rank runs in an eager step while its peers are busy."""

_TOKENS, _MODE, _UNIFORM, _REQS, _SEQ, _PURPOSE = range(6)


def sync_dp(
    group: DPGroup | None,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    config: CaptureConfig,
    *,
    allow_piecewise: bool = True,
    purpose: str = "target",
    component: str = "dp_sync",
) -> tuple[DPSyncState, BatchExecutionDescriptor]:
    """Agree on this step's shape with every DP rank; ``group=None`` means no DP.

    ``purpose`` names the sync (the target step, a drafter's own sync, ...):
    every rank reports it with its collective counter, so a rank that skipped a
    sync its peers ran is caught as DP-3 at the next one instead of silently
    pairing two different collectives.
    """
    if group is None:
        desc = dispatch(num_reqs, num_tokens, uniform_token_count, config, allow_piecewise=allow_piecewise)
        state = DPSyncState(
            dp_size=1,
            cg_mode=desc.cg_mode,
            num_tokens_across_dp=(desc.num_tokens,),
            uniform_token_count=desc.uniform_token_count if desc.cg_mode is CUDAGraphMode.FULL else None,
        )
        _check(state, desc, 0, num_reqs, num_tokens, num_tokens, None, None, component)
        return state, desc

    local = dispatch(num_reqs, num_tokens, uniform_token_count, config, allow_piecewise=allow_piecewise)
    # An idle rank has no batch to constrain the graph choice, so it does not veto one.
    proposed = config.mode if num_tokens == 0 else local.cg_mode
    seq = group.collectives_run
    row = torch.tensor(
        [num_tokens, int(proposed), uniform_token_count or 0, num_reqs, seq, purpose_tag(purpose)], dtype=torch.int64
    )
    table = group.all_gather_rows(row, name=f"dp_sync:{purpose}").tolist()
    tokens = [r[_TOKENS] for r in table]
    seqs = tuple((r[_SEQ], r[_PURPOSE]) for r in table)

    if all(n == 0 for n in tokens):
        state = DPSyncState(
            dp_size=group.size, cg_mode=CUDAGraphMode.NONE, num_tokens_across_dp=tuple(tokens), collective_seq=seq
        )
        desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=num_reqs)
        _check(state, desc, group.rank, num_reqs, num_tokens, 0, seqs, True, component)
        return state, desc

    mode = CUDAGraphMode(min(r[_MODE] for r in table))
    busy_uniform = {r[_UNIFORM] for r in table if r[_TOKENS] > 0}
    if mode is CUDAGraphMode.FULL and (len(busy_uniform) != 1 or 0 in busy_uniform):
        mode = CUDAGraphMode.PIECEWISE if allow_piecewise else CUDAGraphMode.NONE

    if mode is CUDAGraphMode.NONE:
        across = tuple(n if n > 0 else IDLE_DUMMY_TOKENS for n in tokens)
        runs = across[group.rank]
        desc = BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=runs,
            num_reqs=num_reqs,
            uniform_token_count=uniform_token_count if num_tokens > 0 else None,
        )
        state = DPSyncState(dp_size=group.size, cg_mode=mode, num_tokens_across_dp=across, collective_seq=seq)
        _check(state, desc, group.rank, num_reqs, num_tokens, runs, seqs, False, component)
        return state, desc

    max_tokens = max(tokens)
    uniform = busy_uniform.pop() if mode is CUDAGraphMode.FULL else None
    padded = config.bucket(max_tokens, multiple_of=uniform or 1)
    if padded is None:  # every rank reached this point with a capture size that fits the maximum
        raise RuntimeError(f"no capture size fits the DP maximum of {max_tokens} tokens in {mode.name}")
    desc = dispatch(
        num_reqs,
        num_tokens,
        uniform if mode is CUDAGraphMode.FULL else uniform_token_count,
        config,
        min_num_tokens=max_tokens,
        max_mode=mode,
        allow_piecewise=allow_piecewise,
    )
    state = DPSyncState(
        dp_size=group.size,
        cg_mode=mode,
        num_tokens_across_dp=(padded,) * group.size,
        uniform_token_count=uniform,
        collective_seq=seq,
    )
    _check(state, desc, group.rank, num_reqs, num_tokens, num_tokens, seqs, False, component)
    return state, desc


def _check(
    state: DPSyncState,
    desc: BatchExecutionDescriptor,
    rank: int,
    num_reqs: int,
    num_tokens: int,
    runs_unpadded: int,
    seqs: tuple[tuple[int, int], ...] | None,
    all_idle: bool | None,
    component: str,
) -> None:
    check(
        Subject.DP,
        DPFacts(state=state, desc=desc, rank=rank, num_tokens=runs_unpadded, collective_seqs=seqs),
        step_kind=StepKind.DP_SYNC,
        component=component,
    )
    check(
        Subject.DESCRIPTOR,
        DescriptorFacts(desc=desc, num_reqs=num_reqs, num_tokens=num_tokens, all_ranks_idle=all_idle),
        step_kind=StepKind.DP_SYNC,
        component=component,
    )


def pad_model_rows_for_dp(
    desc: BatchExecutionDescriptor, state: DPSyncState, num_reqs: int, uniform_token_count: int
) -> tuple[BatchExecutionDescriptor, tuple[int, ...]]:
    """An eager draft step's descriptor with model rows padded to the largest DP rank.

    Under eager DP each rank keeps its own token count, but a drafter whose
    layers run equal-size collectives (an expert-parallel MoE, as in an MTP
    head) needs every rank to pass the same number of rows. Only the model
    inputs carry this pad; attention metadata must keep the real query rows
    (AR-5, BLK-3). Graph modes are padded by the sync already and pass through.
    """
    if desc.cg_mode is not CUDAGraphMode.NONE or state.dp_size == 1:
        return desc, state.num_tokens_across_dp
    rows = state.max_num_tokens
    padded = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=rows, num_reqs=num_reqs, uniform_token_count=uniform_token_count
    )
    return padded, (rows,) * state.dp_size
