"""``specdec bench-phases``: the step-time split adds up, and the break-even tau is step time over plain's."""

from __future__ import annotations

import pytest

from specdec.backend_registry import create
from specdec.bench.phases import DraftNothing, PhaseTimes, RunnerPhases, draft_policy, report, run_phases, timed
from specdec.draft_length import DraftLengthPolicy
from specdec.metrics import SpeculationCounters
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer


def test_phases_of_a_real_run_add_up_and_the_target_is_restored() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    plain = run_phases(target, [[5, 9, 2], [1, 2, 3, 4]], lambda: None, max_tokens=8, stop_token_ids=())
    spec = run_phases(
        target,
        [[5, 9, 2], [1, 2, 3, 4]],
        lambda: create("dflash", target, num_spec_tokens=3),
        max_tokens=8,
        stop_token_ids=(),
    )
    assert "forward" not in vars(target) and "compute_logits" not in vars(target)  # the timing wrappers are removed
    assert plain.tokens == spec.tokens == 16
    # One token per plain step: the prefill step gives each prompt's first token, 7 decode steps the rest.
    assert (plain.steps, plain.prefill_steps, plain.propose) == (14, 2, 0.0)
    assert 0 < spec.steps <= 14 and spec.prefill_steps == 2 and spec.speculation.verify_steps > 0
    for t in (plain, spec):
        assert 0 < t.target < t.wall and 0 < t.lm_head < t.wall and t.rest > 0 and t.prefill_wall > 0
        assert t.total_wall == t.wall + t.prefill_wall
    assert spec.propose > 0


def test_phases_in_a_batch_and_sampled() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    prompts = [[5, 9, 2], [1, 2, 3, 4], [7, 7], [3, 1, 4, 1, 5]]
    alone = run_phases(target, prompts, lambda: None, max_tokens=6, stop_token_ids=())
    batched = run_phases(target, prompts, lambda: None, max_tokens=6, stop_token_ids=(), batch_size=4)
    assert alone.tokens == batched.tokens == 24
    assert alone.steps == 20 and batched.steps == 5  # one engine step serves the four requests
    assert (alone.prefill_steps, batched.prefill_steps) == (4, 1)
    make = lambda: create("dflash", target, num_spec_tokens=3)  # noqa: E731
    first = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, temperature=1.0)
    again = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, temperature=1.0)
    assert first.tokens == 24 and first.speculation.counts() == again.speculation.counts()  # seeded per request


def test_report_gives_the_break_even_tau() -> None:
    plain = RunnerPhases(
        "plain",
        [PhaseTimes(steps=10, wall=0.2, target=0.12, lm_head=0.03, tokens=11, prefill_steps=1, prefill_wall=0.02)],
    )
    spec = RunnerPhases(
        "x",
        [
            PhaseTimes(
                steps=5,
                wall=0.15,
                target=0.08,
                lm_head=0.02,
                propose=0.03,
                decide=0.005,
                tokens=11,
                prefill_steps=1,
                prefill_wall=0.015,
                speculation=SpeculationCounters(verify_steps=5, emitted_in_verify=10),
            )
        ],
    )
    spec.rounds[0].speculation.drafted = 15
    table = report([plain, spec]).splitlines()
    # Per-step columns leave the prefill out; tokens/s (11 tokens in 0.22 and 0.165 s) takes it in.
    assert table[2] == "| plain | 20.0 | 12.0 | 3.0 | - | - | 5.0 | - | - | 20.0 | 50.0 | 1.000 | - |"
    assert table[3] == "| x | 30.0 | 16.0 | 4.0 | 6.0 | 1.00 | 3.0 | 3.00 | 2.00 | 15.0 | 66.7 | 1.333 | 1.50 |"
    assert spec.per_step_ms("rest") == pytest.approx(3.0)


def test_speedup_is_the_median_of_same_round_ratios() -> None:
    plain = RunnerPhases("plain", [PhaseTimes(steps=1, wall=w, tokens=10) for w in (1.0, 2.0, 4.0)])
    spec = RunnerPhases("x", [PhaseTimes(steps=1, wall=w, tokens=10) for w in (0.5, 2.0, 2.0)])
    # Ratios 2.0, 1.0, 2.0 round by round; the ratio of the two medians of tokens/s would be 5.0 / 5.0.
    assert spec.speedup_over(plain) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="x ran 2 rounds, plain 3"):
        RunnerPhases("x", spec.rounds[:2]).speedup_over(plain)


def test_draft_lengths_idle_drafts_nothing_and_adaptive_learns_across_runs() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    prompts = [[5, 9, 2], [1, 2, 3, 4], [7, 7], [3, 1, 4, 1, 5]]
    make = lambda: create("dflash", target, num_spec_tokens=3)  # noqa: E731
    plain = run_phases(target, prompts, lambda: None, max_tokens=6, stop_token_ids=(), batch_size=2)
    idle = draft_policy("idle", 3)
    assert isinstance(idle, DraftNothing)
    quiet = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, policy=idle)
    assert quiet.speculation.drafted == 0 and quiet.propose > 0  # the drafter still ran to keep its context
    assert plain.decide == 0.0 < quiet.decide and "choose" not in vars(idle)  # timed, then the timing removed
    spied, inner = draft_policy("idle", 3), []  # a choose the caller set on the policy is put back, not deleted
    assert spied is not None
    original = spied.choose

    def spy(*args: object, **kwargs: object) -> dict[str, int]:
        inner.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    spied.choose = spy  # type: ignore[method-assign]
    run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, policy=spied)
    assert spied.choose is spy and inner
    assert (quiet.steps, quiet.tokens) == (plain.steps, plain.tokens) and idle.decisions > 0
    adaptive = draft_policy("adaptive", 3)
    assert type(adaptive) is DraftLengthPolicy and draft_policy("fixed", 3) is None
    first = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, policy=adaptive)
    decisions = adaptive.decisions
    assert first.speculation.drafted > 0 and decisions > 0
    run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, policy=adaptive)
    assert adaptive.decisions > decisions  # one policy continued by every engine, as a server keeps it
    with pytest.raises(ValueError, match="draft length must be one of fixed, adaptive, idle, got 'often'"):
        draft_policy("often", 3)


def test_the_lm_head_inside_a_proposal_is_the_proposals_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter that scores the target's whole LM head (``--full-vocab``) calls it within its proposal."""
    clock = iter(range(100))
    monkeypatch.setattr("specdec.bench.phases.time.perf_counter", lambda: float(next(clock)))
    times = PhaseTimes()
    head = timed(lambda: None, times, "lm_head", not_within="propose")
    propose = timed(head, times, "propose")
    propose()  # one clock tick inside: the proposal's, and the LM head's clock is not read
    head()  # the engine's own LM head
    assert (times.propose, times.lm_head, times.open_phases) == (1.0, 1.0, [])


def test_a_prefill_steps_phases_are_left_out_of_the_decode_steps() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    only = run_phases(target, [[5, 9, 2], [1, 2]], lambda: None, max_tokens=1, stop_token_ids=())  # prefills only
    assert (only.steps, only.prefill_steps, only.tokens) == (0, 2, 2) and only.prefill_wall > 0
    assert (only.wall, only.target, only.lm_head, only.propose, only.decide) == (0.0, 0.0, 0.0, 0.0, 0.0)
