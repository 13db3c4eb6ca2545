"""The engine under the adaptive draft length: lossless, drafts only what pays, verifies no more than its budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from tests_support import perturbed_copy

from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, TargetStep
from specdec.step_cost import StepCost

CONFIG = EngineConfig(num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96))
ADAPTIVE = EngineConfig(
    num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96), draft_length="adaptive"
)
PROMPTS = [(3, 17, 40), (5, 9), (11, 12, 13, 14)]
DRAFTS_PAY = StepCost(base=0.02, per_row=0.0005, per_proposal=0.001, per_draft=0.0005)
DRAFTS_NEVER_PAY = StepCost(base=0.02, per_row=0.02, per_proposal=0.05, per_draft=0.02)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(), seed=0)


def run(engine: Engine, max_tokens: int = 40) -> tuple[list[list[int]], list[int], int]:
    """Outputs by prompt, drafts verified per request step, verify steps."""
    reqs = [engine.add_request(f"q{i}", p, max_tokens=max_tokens) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    drafted = [r.metrics.drafted for r in reqs]
    return [list(r.output) for r in reqs], drafted, sum(r.metrics.verify_steps for r in reqs)


def plain(target: Transformer) -> list[list[int]]:
    return run(Engine(target, CONFIG))[0]


def self_drafter(target: Transformer) -> AutoregressiveSpeculator:
    return AutoregressiveSpeculator(ModelDrafter(target), num_spec_tokens=4, name="self")


def test_a_drafter_the_target_agrees_with_drafts_k_every_step(target: Transformer) -> None:
    policy = DraftLengthPolicy(4, cost=DRAFTS_PAY)
    engine = Engine(target, ADAPTIVE, speculator=self_drafter(target), draft_policy=policy)
    outputs, drafted, steps = run(engine)
    assert outputs == plain(target)
    # 40 tokens each, every draft accepted: the prior's gains (0.5, 0.25, ...) pay for 2 drafts, then 3 once the
    # first are accepted, then K until two tokens are left, when 1 draft is all the last step can use.
    assert drafted == [2 + 3 + 4 * 6 + 1] * 3 and steps == 3 * 9
    assert engine.metrics.decisions == "234444441"  # the run's trace: one character per decision, in order


def test_drafts_that_never_pay_make_it_plain_decoding_but_for_probes(target: Transformer) -> None:
    bad = AutoregressiveSpeculator(ModelDrafter(perturbed_copy(target, 5.0, 1)), num_spec_tokens=4, name="bad")
    policy = DraftLengthPolicy(4, cost=DRAFTS_NEVER_PAY, probe_every=8)
    engine = Engine(target, ADAPTIVE, speculator=bad, draft_policy=policy)
    outputs, drafted, steps = run(engine)
    assert outputs == plain(target)
    assert sum(drafted) <= steps // 8 + len(PROMPTS)  # one-draft probes only
    # A decision on every step but the last (nobody is left to draft after it), each one drafting nothing.
    assert engine.metrics.decisions == "." * (engine.metrics.steps - 1) == "." * policy.decisions


def test_the_measured_policy_is_lossless_greedy_and_varies_its_lengths(target: Transformer) -> None:
    spec = AutoregressiveSpeculator(ModelDrafter(perturbed_copy(target, 0.6, 3)), num_spec_tokens=4, name="p")
    engine = Engine(target, ADAPTIVE, speculator=spec)
    outputs, _, _ = run(engine)
    assert outputs == plain(target)
    assert engine.draft_policy is not None and engine.draft_policy.cost.fitted is not None


class OneDraft(DraftLengthPolicy):
    """A policy that always allows one draft: what the engine then verifies is the test's subject."""

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        return dict.fromkeys(req_ids, 1)


class IgnoresBudget(AutoregressiveSpeculator):
    """Drafts K whatever the budget, as a third-party drafter that never reads ``step.max_drafts`` would."""

    def propose(self, step: TargetStep, ctx: DraftContext) -> Proposal:
        full = TargetStep(**{**step.__dict__, "max_drafts": ()})
        return super().propose(full, ctx)


def test_the_engine_verifies_no_more_drafts_than_the_budget(target: Transformer) -> None:
    spec = IgnoresBudget(ModelDrafter(target), num_spec_tokens=4, name="ignores")
    outputs, drafted, steps = run(Engine(target, ADAPTIVE, speculator=spec, draft_policy=OneDraft(4)))
    assert outputs == plain(target)
    assert 0 < sum(drafted) <= steps


def test_sampling_under_the_adaptive_length_stays_valid(target: Transformer) -> None:
    engine = Engine(target, ADAPTIVE, speculator=self_drafter(target))
    params = SamplingParams(temperature=1.0)
    reqs = [engine.add_request(f"s{i}", p, params=params, max_tokens=30, seed=i) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    assert all(len(r.output) == 30 for r in reqs)


def test_a_policy_for_another_k_or_a_fixed_engine_is_refused(target: Transformer) -> None:
    with pytest.raises(ValueError, match="draft_policy"):
        Engine(target, ADAPTIVE, speculator=self_drafter(target), draft_policy=DraftLengthPolicy(3))
    with pytest.raises(ValueError, match="draft_policy"):
        Engine(target, CONFIG, speculator=self_drafter(target), draft_policy=DraftLengthPolicy(4))
    with pytest.raises((ValueError, TypeError), match="draft_length"):  # TypeError: under the type hook
        EngineConfig(draft_length="sometimes")  # type: ignore[arg-type]


class NeverDraft(DraftLengthPolicy):
    """A policy that never drafts (no probes either): every step is plain decoding through a drafter's engine."""

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        return dict.fromkeys(req_ids, 0)


def test_steps_that_draft_nothing_sample_exactly_as_plain_decoding(target: Transformer) -> None:
    """With no drafts the verifier draws nothing for the K empty slots: the same random stream, the same tokens."""

    def sampled(engine: Engine) -> list[list[int]]:
        params = SamplingParams(temperature=1.0)
        reqs = [engine.add_request(f"s{i}", p, params=params, max_tokens=24, seed=i) for i, p in enumerate(PROMPTS)]
        while engine.has_work:
            engine.step()
        return [list(r.output) for r in reqs]

    spec = Engine(target, ADAPTIVE, speculator=self_drafter(target), draft_policy=NeverDraft(4))
    assert sampled(spec) == sampled(Engine(target, CONFIG))
    assert spec.metrics.snapshot().counts()["drafted"] == 0


def test_the_engine_tells_the_policy_what_each_request_has_left_and_whether_anyone_waits(target: Transformer) -> None:
    """One slot, three requests: the first two decode with others waiting, the last drains the engine."""
    seen: list[tuple[dict[str, int], bool, dict[str, int]]] = []

    class Spy(DraftLengthPolicy):
        def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: Any) -> dict[str, int]:
            left: Mapping[str, int] = context["remaining"]
            seen.append((dict(left), context["draining"], {r: len(engine.requests[r].output) for r in req_ids}))
            return super().choose(req_ids, base_rows=base_rows, **context)

    one_slot = dataclasses.replace(ADAPTIVE, scheduler=SchedulerConfig(max_model_len=96, max_num_seqs=1))
    engine = Engine(target, one_slot, speculator=self_drafter(target), draft_policy=Spy(4, cost=DRAFTS_PAY))
    outputs = run(engine, max_tokens=12)[0]
    assert outputs == [o[:12] for o in plain(target)]
    assert all(left == {r: 12 - n for r, n in out.items()} for left, _, out in seen)
    by_request = [[d for left, d, _ in seen if f"q{i}" in left] for i in range(3)]
    assert not any(by_request[0] + by_request[1]) and all(by_request[2])  # only the last has nobody behind it
