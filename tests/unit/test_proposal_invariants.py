"""PROP-*: every proposal has one row and one count per request of its target step, counts in [0, K], and none
for a request that does not draft; checked through the registry, and refused with contracts ``off`` too.

Each planted fault starts from a real proposal of a built-in drafter on a real
target step (chunked prefill, so some requests do not draft) and breaks one thing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

import contracts
from backends import create
from contracts import BatchExecutionDescriptor, ContractViolation, CUDAGraphMode
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import MalformedProposalError, Proposal, Speculator, TargetStep, check_proposal

K = 3
PROMPTS = {"a": list(range(3, 13)), "b": list(range(20, 27)), "c": list(range(30, 42))}


class Recording:
    """A drafter wrapper that keeps every (target step, proposal) pair the engine saw."""

    def __init__(self, inner: Speculator) -> None:
        self.inner, self.name, self.num_spec_tokens = inner, inner.name, inner.num_spec_tokens
        self.draft_step_kinds, self.aux_layers = inner.draft_step_kinds, inner.aux_layers
        self.seen: list[tuple[TargetStep, Proposal]] = []

    def bind(self, target: Transformer, ctx: Any) -> None:
        self.inner.bind(target, ctx)

    def propose(self, step: TargetStep, ctx: Any) -> Proposal:
        proposal = self.inner.propose(step, ctx)
        self.seen.append((step, proposal))
        return proposal

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)


@functools.cache
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(), seed=0)


def run(backend: str, mode: str, speculator: Speculator | None = None) -> Recording:
    """Three requests on a small token budget: prompts are prefilled in chunks while others decode."""
    spec = Recording(speculator or create(backend, target(), num_spec_tokens=K))
    config = EngineConfig(num_blocks=128, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    engine = Engine(target(), config, speculator=spec)
    for req_id, prompt in PROMPTS.items():
        engine.add_request(req_id, prompt, max_tokens=6)
    with contracts.enforce(mode):
        engine.run(max_steps=200)
    return spec


@functools.cache
def mixed_step() -> tuple[TargetStep, Proposal, Speculator]:
    """A real eagle step in which some requests draft and some (mid-prefill) do not."""
    spec = run("eagle", "full")
    for step, proposal in spec.seen:
        if any(step.drafting) and not all(step.drafting) and step.num_reqs > 1:
            return step, proposal, spec
    raise AssertionError("no step mixed drafting and non-drafting requests")


def violated(proposal: Proposal, step: TargetStep | None = None, mode: str = "shapes") -> ContractViolation:
    real_step, _, spec = mixed_step()
    with contracts.enforce(mode), pytest.raises(ContractViolation) as info:
        check_proposal(proposal, step or real_step, spec)
    return info.value


def refused_off(proposal: Proposal, step: TargetStep | None = None) -> MalformedProposalError:
    real_step, _, spec = mixed_step()
    with contracts.enforce("off"), pytest.raises(MalformedProposalError) as info:
        check_proposal(proposal, step or real_step, spec)
    return info.value


def _first(flags: tuple[bool, ...], value: bool) -> int:
    return flags.index(value)


# -- silent on the built-ins ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eagle", "draft-model", "dflash", "dspark", "ngram"])
def test_the_built_in_drafters_break_no_prop_invariant(backend: str) -> None:
    spec = run(backend, "full")
    steps = [step for step, _ in spec.seen]
    assert any(not all(s.drafting) for s in steps), "the run must have non-drafting requests for PROP-4 to mean much"
    assert any(n for _, p in spec.seen for n in p.num_drafts), "the run must draft"
    for step, proposal in spec.seen:
        with contracts.enforce("off"):
            check_proposal(proposal, step, spec)  # the off-mode guard is silent too


def test_the_mixed_step_passes_in_every_mode() -> None:
    step, proposal, spec = mixed_step()
    for mode in ("off", "shapes", "full"):
        with contracts.enforce(mode):
            check_proposal(proposal, step, spec)


# -- PROP-1: rows -----------------------------------------------------------------------------------------------------


def test_one_row_too_many_is_prop_1() -> None:
    step, proposal, _ = mixed_step()
    ids = torch.cat([proposal.draft_token_ids, proposal.draft_token_ids[:1]])
    err = violated(dataclasses.replace(proposal, draft_token_ids=ids))
    assert err.invariant_id == "PROP-1" and err.observed["draft rows"] == step.num_reqs + 1
    assert refused_off(dataclasses.replace(proposal, draft_token_ids=ids)).invariant_id == "PROP-1"


def test_rows_sized_to_the_dp_padded_count_name_the_pad() -> None:
    step, proposal, _ = mixed_step()
    padded = step.num_reqs + 2
    desc = BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=max(step.desc.num_tokens, padded), num_reqs=padded
    )
    step = dataclasses.replace(step, desc=desc)
    ids = torch.cat([proposal.draft_token_ids, proposal.draft_token_ids.new_full((2, K), 0)])
    err = violated(dataclasses.replace(proposal, draft_token_ids=ids), step)
    assert err.invariant_id == "PROP-1" and err.observed["num_reqs_padded"] == padded
    assert "DP-padded request count" in (err.likely_cause or "")


# -- PROP-2: one count per request -----------------------------------------------------------------------------------


def test_counts_for_the_drafting_requests_only_are_prop_2() -> None:
    step, proposal, _ = mixed_step()
    counts = tuple(n for n, d in zip(proposal.num_drafts, step.drafting, strict=True) if d)
    err = violated(dataclasses.replace(proposal, num_drafts=counts))
    assert err.invariant_id == "PROP-2" and "drafting requests only" in (err.likely_cause or "")
    assert refused_off(dataclasses.replace(proposal, num_drafts=counts)).invariant_id == "PROP-2"


def test_counts_as_a_tensor_are_prop_2() -> None:
    _, proposal, _ = mixed_step()
    forged = dataclasses.replace(proposal)
    object.__setattr__(forged, "num_drafts", torch.tensor(proposal.num_drafts))
    err = violated(forged)
    assert err.invariant_id == "PROP-2" and err.observed["num_drafts"] == "Tensor"
    assert refused_off(forged).invariant_id == "PROP-2"


# -- PROP-3: counts in [0, K] -----------------------------------------------------------------------------------------


def test_a_count_of_k_plus_one_is_prop_3() -> None:
    step, proposal, _ = mixed_step()
    r = _first(step.drafting, True)
    counts = tuple(K + 1 if i == r else n for i, n in enumerate(proposal.num_drafts))
    err = violated(dataclasses.replace(proposal, num_drafts=counts), mode="full")
    assert err.invariant_id == "PROP-3" and err.observed["(request, count)"] == [(step.req_ids[r], K + 1)]
    assert refused_off(dataclasses.replace(proposal, num_drafts=counts)).invariant_id == "PROP-3"


def test_a_negative_or_tensor_count_is_prop_3() -> None:
    step, proposal, _ = mixed_step()
    r = _first(step.drafting, True)
    for bad in (-1, torch.tensor(1), 1.0, True):
        counts = tuple(bad if i == r else n for i, n in enumerate(proposal.num_drafts))
        # Built past the dataclass's type check (tests run with it on): a drafter's counts reach the engine unchecked.
        forged = dataclasses.replace(proposal)
        object.__setattr__(forged, "num_drafts", counts)
        err = violated(forged)
        assert err.invariant_id == "PROP-3", bad


# -- PROP-4: no drafts for a request that does not draft ------------------------------------------------------------


def test_drafts_for_a_request_still_in_prefill_are_prop_4() -> None:
    step, proposal, _ = mixed_step()
    r = _first(step.drafting, False)
    counts = tuple(1 if i == r else n for i, n in enumerate(proposal.num_drafts))
    err = violated(dataclasses.replace(proposal, num_drafts=counts))
    assert err.invariant_id == "PROP-4" and err.observed["(request, count)"] == [(step.req_ids[r], 1)]
    off = refused_off(dataclasses.replace(proposal, num_drafts=counts))
    assert off.invariant_id == "PROP-4" and "[PROP-4]" in str(off) and "contracts off" in str(off)
    assert isinstance(off, ValueError)


# -- through the engine ------------------------------------------------------------------------------------------------


class DraftsForEveryone(Recording):
    """A drafter that ignores ``step.drafting``: K drafts for every request."""

    def propose(self, step: TargetStep, ctx: Any) -> Proposal:
        proposal = self.inner.propose(step, ctx)
        return dataclasses.replace(proposal, num_drafts=(K,) * step.num_reqs)


@pytest.mark.parametrize("mode", ["off", "shapes"])
def test_the_engine_refuses_drafts_for_non_drafting_requests_in_every_mode(mode: str) -> None:
    expected = MalformedProposalError if mode == "off" else ContractViolation
    with pytest.raises(expected) as info:
        run("eagle", mode, DraftsForEveryone(create("eagle", target(), num_spec_tokens=K)))
    assert getattr(info.value, "invariant_id", None) == "PROP-4"


def test_prop_runs_before_the_drafters_own_proposal_invariants() -> None:
    """Rows sized wrongly and K columns wrong: the generic row count (PROP-1) is named, AR-9 after it."""
    _, proposal, _ = mixed_step()
    ids = proposal.draft_token_ids[:-1, :-1]
    assert violated(dataclasses.replace(proposal, draft_token_ids=ids)).invariant_id == "PROP-1"
    assert (
        violated(dataclasses.replace(proposal, draft_token_ids=proposal.draft_token_ids[:, :-1])).invariant_id == "AR-9"
    )
