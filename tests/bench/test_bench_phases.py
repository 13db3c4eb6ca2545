"""``specdec bench-phases``: the step-time split adds up, and the break-even tau is step time over plain's."""

from __future__ import annotations

import pytest

from specdec.backend_registry import create
from specdec.bench.phases import PhaseTimes, RunnerPhases, report, run_phases
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
    assert "forward" not in vars(target)  # the timing wrapper is removed again
    assert plain.tokens == spec.tokens == 16
    assert plain.steps == 16 and plain.propose == 0.0  # one token per plain step, prefill included
    assert 0 < spec.steps <= 16 and spec.speculation.verify_steps > 0
    for t in (plain, spec):
        assert 0 < t.target < t.wall and t.rest > 0
    assert spec.propose > 0


def test_phases_in_a_batch_and_sampled() -> None:
    target = Transformer(ModelConfig.tiny(vocab_size=32), seed=0)
    prompts = [[5, 9, 2], [1, 2, 3, 4], [7, 7], [3, 1, 4, 1, 5]]
    alone = run_phases(target, prompts, lambda: None, max_tokens=6, stop_token_ids=())
    batched = run_phases(target, prompts, lambda: None, max_tokens=6, stop_token_ids=(), batch_size=4)
    assert alone.tokens == batched.tokens == 24
    assert alone.steps == 24 and batched.steps == 6  # one engine step serves the four requests
    make = lambda: create("dflash", target, num_spec_tokens=3)  # noqa: E731
    first = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, temperature=1.0)
    again = run_phases(target, prompts, make, max_tokens=6, stop_token_ids=(), batch_size=2, temperature=1.0)
    assert first.tokens == 24 and first.speculation.counts() == again.speculation.counts()  # seeded per request


def test_report_gives_the_break_even_tau() -> None:
    plain = RunnerPhases("plain", [PhaseTimes(steps=10, wall=0.2, target=0.15, tokens=10)])
    spec = RunnerPhases(
        "x",
        [
            PhaseTimes(
                steps=5,
                wall=0.15,
                target=0.1,
                propose=0.03,
                tokens=10,
                speculation=SpeculationCounters(verify_steps=5, emitted_in_verify=10),
            )
        ],
    )
    table = report([plain, spec]).splitlines()
    assert table[2] == "| plain | 20.0 | 15.0 | - | 5.0 | - | 50.0 | - |"
    assert table[3] == "| x | 30.0 | 20.0 | 6.0 | 4.0 | 2.00 | 66.7 | 1.50 |"
    assert spec.per_step_ms("rest") == pytest.approx(4.0)
