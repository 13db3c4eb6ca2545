"""The Medusa backend: lossless under the engine's batching, an idle DP rank in every heads step, and its bugs caught.

Only public names are used: ``specdec``'s top level, ``contracts``, the
registry and the testing kit, as a third-party backend's tests would. The
planted bugs are the ones a heads drafter is most likely to write: forgetting
the DP pad, counting it as requests, and an idle rank skipping the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from jaxtyping import Float
from specdec_medusa import MedusaHeads, MedusaSpeculator, make_speculator
from torch import Tensor

import contracts
from contracts import ContractViolation
from specdec import DraftContext, Engine, EngineConfig, ModelConfig, Proposal, SamplingParams, TargetStep, Transformer
from specdec.backend_registry import available_backends, create
from specdec.testing.dp_run import DPRunSpec, RequestSpec, dp_run_specs, merged, plain_outputs, run_in_process

MODEL = ModelConfig.tiny()


@functools.cache
def target(seed: int = 0) -> Transformer:
    return Transformer(MODEL, seed=seed)


def medusa_k3(t: Transformer) -> MedusaSpeculator:
    """Module-level, so a ``DPRunSpec`` holding it stays picklable."""
    return make_speculator(t, num_spec_tokens=3)


def requests(prefix: str, n: int, max_tokens: int = 12) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(f"{prefix}{i}", (3 + i, 14, 15, 92, 65) * 2, max_tokens=max_tokens) for i in range(n))


# -- the heads -------------------------------------------------------------------------------------


def test_heads_give_one_distribution_per_row_and_head_and_follow_the_seed() -> None:
    hidden = torch.randn(5, MODEL.hidden_size)
    a = MedusaHeads(target(), 3, seed=1)(hidden, dp_group=None, num_tokens_across_dp=None)
    b = MedusaHeads(target(), 3, seed=1)(hidden, dp_group=None, num_tokens_across_dp=None)
    c = MedusaHeads(target(), 3, seed=2)(hidden, dp_group=None, num_tokens_across_dp=None)
    assert a.shape == (5, 3, MODEL.vocab_size) and torch.equal(a, b) and not torch.equal(a, c)


def test_bad_options_are_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"num_heads \(K\) must be >= 1, got 0"):
        make_speculator(target(), num_spec_tokens=0)


def test_the_entry_point_makes_it_a_backend() -> None:
    assert {"medusa", "eagle", "dflash"} <= set(available_backends())
    spec = create("medusa", target(), num_spec_tokens=5, seed=3)
    assert isinstance(spec, MedusaSpeculator) and spec.num_spec_tokens == 5


# -- losslessness ----------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(dp_run_specs(MODEL))
def test_greedy_output_equals_plain_decoding_on_any_batching(spec: DPRunSpec) -> None:
    """Uneven DP ranks, chunked prefills, graph modes: drafting changes when tokens come out, never which."""
    spec = dataclasses.replace(spec, speculator=medusa_k3)
    assert merged(run_in_process(spec)) == plain_outputs(spec)


def test_sampled_output_is_valid_with_one_hot_proposals() -> None:
    engine = Engine(target(), EngineConfig(seed=3), speculator=make_speculator(target(), num_spec_tokens=3))
    for i in range(3):
        engine.add_request(f"s{i}", [1, 2, 3, i], params=SamplingParams(temperature=0.8), max_tokens=12)
    with contracts.enforce("full"):
        outputs = engine.run()
    assert all(len(out) == 12 and all(0 <= t < MODEL.vocab_size for t in out) for out in outputs.values())


# -- the idle rank ---------------------------------------------------------------------------------


class RecordingHeads(MedusaHeads):
    """The heads, recording ``(rank, rows)`` of every forward: the evidence that an idle rank ran its dummy step."""

    seen: list[tuple[int, int]] = []  # noqa: RUF012  (shared across the ranks' threads on purpose)

    def __call__(
        self,
        hidden_states: Float[Tensor, "rows hidden"],
        *,
        dp_group: Any,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> Float[Tensor, "rows heads vocab"]:
        RecordingHeads.seen.append((dp_group.rank if dp_group is not None else 0, hidden_states.shape[0]))
        return super().__call__(hidden_states, dp_group=dp_group, num_tokens_across_dp=num_tokens_across_dp)


def recording_medusa(t: Transformer) -> MedusaSpeculator:
    return MedusaSpeculator(RecordingHeads(t, 3))


def test_an_idle_rank_runs_the_dummy_heads_step_its_peer_syncs() -> None:
    """Rank 1 has no request at all: it still syncs each step and runs the heads on the rows rank 0 drafts."""
    RecordingHeads.seen.clear()
    spec = DPRunSpec(MODEL, 0, EngineConfig(), (requests("a", 3), ()), recording_medusa)
    with contracts.enforce("full"):
        results = run_in_process(spec)
    assert merged(results) == plain_outputs(spec)
    by_rank = {rank: [rows for r, rows in RecordingHeads.seen if r == rank] for rank in (0, 1)}
    assert by_rank[1] and by_rank[1] == by_rank[0], "the idle rank's heads rows follow the busy rank's, step by step"
    assert results[0].collectives == results[1].collectives


# -- planted bugs ----------------------------------------------------------------------------------


class UnpaddedHidden(MedusaSpeculator):
    """Bug: the heads get the drafting requests' rows only, not the DP-padded ``desc.num_tokens`` rows."""

    def propose(self, step: TargetStep, ctx: DraftContext) -> Any:
        real = ctx.forward_heads

        def unpadded(heads: Any, desc: Any, num_reqs: int, hidden: Tensor, **kw: Any) -> Tensor:
            return real(heads, desc, num_reqs, hidden[:num_reqs], **kw)

        ctx.forward_heads = unpadded  # type: ignore[method-assign]
        try:
            return super().propose(step, ctx)
        finally:
            del ctx.forward_heads


class PadCountedAsRequests(MedusaSpeculator):
    """Bug: the DP-padded row count handed over as the number of drafting requests."""

    def propose(self, step: TargetStep, ctx: DraftContext) -> Any:
        real = ctx.forward_heads

        def confused(heads: Any, desc: Any, num_reqs: int, hidden: Tensor, **kw: Any) -> Tensor:
            return real(heads, desc, desc.num_tokens, hidden, **kw)

        ctx.forward_heads = confused  # type: ignore[method-assign]
        try:
            return super().propose(step, ctx)
        finally:
            del ctx.forward_heads


class IdleRankSkips(MedusaSpeculator):
    """Bug: a rank with nothing to draft returns at once, skipping the sync (and dummy step) its peers run."""

    def propose(self, step: TargetStep, ctx: DraftContext) -> Any:
        if not any(step.drafting):
            k = self.num_spec_tokens
            ids = torch.full((step.num_reqs, k), contracts.REJECTED_TOKEN_ID, dtype=torch.int64)
            return Proposal(draft_token_ids=ids, num_drafts=(0,) * step.num_reqs)
        return super().propose(step, ctx)


def unpadded(t: Transformer) -> MedusaSpeculator:
    return UnpaddedHidden(MedusaHeads(t, 3))


def pad_as_requests(t: Transformer) -> MedusaSpeculator:
    return PadCountedAsRequests(MedusaHeads(t, 3))


def idle_skips(t: Transformer) -> MedusaSpeculator:
    return IdleRankSkips(MedusaHeads(t, 3))


@pytest.mark.parametrize(
    ("factory", "expected"),
    [(unpadded, "HEAD-2"), (pad_as_requests, "DESC-3"), (idle_skips, "DP-3")],
    ids=["unpadded-hidden", "dp-pad-as-requests", "idle-rank-skips"],
)
def test_planted_dp_bugs_are_caught_at_the_heads_step(factory: Any, expected: str) -> None:
    """Uneven ranks (3 drafting requests against 1 that finishes early): every bug shows only under DP."""
    spec = DPRunSpec(MODEL, 0, EngineConfig(), (requests("a", 3), requests("b", 1, max_tokens=2)), factory)
    with contracts.enforce("shapes"), pytest.raises(ContractViolation) as caught:
        run_in_process(spec, timeout_s=20.0)
    assert caught.value.invariant_id == expected
