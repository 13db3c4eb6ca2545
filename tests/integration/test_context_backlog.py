"""Context writes held while no request drafts: the drafts are exactly those of writing every step at once.

EAGLE, DFlash and DSpark hold the committed rows of steps that draft nothing and
write them, in order, before their next forward that reads the draft cache (or
when the backlog is full). The oracle is the same drafter writing each step's
context at once (``max_held_rows=1``): same schedule, same proposals, token for
token, with and without preemption in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from backends import create
from backends.context_backlog import ContextBacklog, ContextRows
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, Proposal, TargetStep

TARGET = Transformer(ModelConfig.tiny(), seed=0)
PROMPTS = [(5, 17, 40, 8, 61, 2), (6, 17, 41, 8), (7, 3, 42, 8, 61, 2, 9, 9, 1), (8, 17)]


class DraftsEveryFourth(DraftLengthPolicy):
    """Two drafts for every request on every fourth decision, none otherwise: long idle spells to hold."""

    calls = 0

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        self.calls += 1
        return dict.fromkeys(req_ids, 2 if self.calls % 4 == 0 else 0)


def run(kind: str, max_held_rows: int, *, num_blocks: int) -> tuple[list[list[int]], dict[str, list[int]], int, int]:
    """Every proposal's drafts, the outputs, the context writes the network made, and the preemptions."""
    spec = create(kind, TARGET, num_spec_tokens=3)
    spec.max_held_rows = max_held_rows  # type: ignore[attr-defined]
    drafts: list[list[int]] = []
    writes = [0]
    network: Any = spec.network  # type: ignore[attr-defined]
    write_name = "write_context" if kind == "eagle" else "inject_context"
    real_write = getattr(network, write_name)

    def counted(*args: Any, **kwargs: Any) -> None:
        writes[0] += 1
        real_write(*args, **kwargs)

    setattr(network, write_name, counted)
    real_propose = spec.propose

    def propose(step: TargetStep, ctx: DraftContext) -> Proposal:
        proposal = real_propose(step, ctx)
        drafts.append(proposal.draft_token_ids.flatten().tolist())
        return proposal

    spec.propose = propose  # type: ignore[method-assign]
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=2,
        draft_length="adaptive",
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=64),
    )
    engine = Engine(TARGET, config, speculator=spec, draft_policy=DraftsEveryFourth(3))
    reqs = [engine.add_request(f"r{i}", list(p), max_tokens=14) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    return drafts, {r.req_id: list(r.output) for r in reqs}, writes[0], sum(r.metrics.preemptions for r in reqs)


def plain(num_blocks: int) -> dict[str, list[int]]:
    config = EngineConfig(
        num_blocks=num_blocks, block_size=2, scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=64)
    )
    engine = Engine(TARGET, config)
    reqs = [engine.add_request(f"r{i}", list(p), max_tokens=14) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    return {r.req_id: list(r.output) for r in reqs}


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy", "preempting"])
@pytest.mark.parametrize("kind", ["eagle", "dflash", "dspark"])
def test_held_context_gives_the_drafts_of_writing_it_at_once(kind: str, num_blocks: int) -> None:
    at_once, out_at_once, writes_at_once, preempted = run(kind, 1, num_blocks=num_blocks)
    held, out_held, writes_held, preempted_held = run(kind, 256, num_blocks=num_blocks)
    small, out_small, writes_small, _ = run(kind, 5, num_blocks=num_blocks)
    assert out_at_once == out_held == out_small == plain(num_blocks)
    assert held == at_once and small == at_once
    assert sum(d >= 0 for step in at_once for d in step) > 10, "too few drafts to compare"
    assert writes_held < writes_at_once, "nothing was held: the idle steps wrote their context at once"
    assert writes_held < writes_small < writes_at_once, "a backlog of 5 rows should write when full, in between"
    assert preempted == preempted_held
    if num_blocks == 20:
        assert preempted, "the cache was sized so that preemption must happen"


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_dropping_the_held_rows_changes_the_drafts(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug the test above exists for: held rows that are never written leave stale context."""
    at_once, *_ = run(kind, 1, num_blocks=256)
    monkeypatch.setattr(ContextBacklog, "hold", lambda self, rows: None)
    dropped, *_ = run(kind, 256, num_blocks=256)
    assert dropped != at_once


def rows(slots: Sequence[int], start: float) -> ContextRows:
    n = len(slots)
    return ContextRows((torch.arange(n, dtype=torch.float32) + start,), torch.arange(n), tuple(slots))


def test_a_backlog_writes_in_order_and_keeps_each_slots_latest_row() -> None:
    backlog = ContextBacklog(max_rows=6)
    assert backlog.hold(rows([3, 4], 0.0)) is None
    assert backlog.hold(rows([], 50.0)) is None and backlog.rows == 2
    assert backlog.hold(rows([4, 5, 3], 10.0)) is None and backlog.rows == 5
    merged = backlog.take(then=rows([5], 20.0))
    assert merged is not None and backlog.rows == 0 and backlog.take() is None
    assert merged.slots == (4, 3, 5)  # slot 4's and 3's later rows, then the newest row for 5
    assert merged.features[0].tolist() == [10.0, 12.0, 20.0]


def test_a_full_backlog_or_rows_that_do_not_fit_are_due_at_once() -> None:
    backlog = ContextBacklog(max_rows=4)
    assert backlog.hold(rows([1, 2, 3], 0.0)) is None
    due = backlog.hold(rows([7, 8], 10.0))  # 5 rows do not fit in 4: everything, in order, is due now
    assert due is not None and due.slots == (1, 2, 3, 7, 8) and due.features[0].tolist() == [0, 1, 2, 10, 11]
    assert backlog.rows == 0
    assert backlog.hold(rows([1, 2], 0.0)) is None
    full = backlog.hold(rows([3, 4], 5.0))
    assert full is not None and full.slots == (1, 2, 3, 4) and backlog.rows == 0


def test_held_rows_are_copies_not_the_forwards_tensors() -> None:
    """The features are the target's layer outputs: the backlog must not keep them alive (or see them change)."""
    backlog = ContextBacklog(max_rows=8)
    source = rows([1, 2], 0.0)
    backlog.hold(source)
    source.features[0].add_(100.0)
    taken = backlog.take()
    assert taken is not None and taken.features[0].tolist() == [0.0, 1.0]


def test_context_rows_must_agree_on_their_count_and_layout() -> None:
    with pytest.raises(ValueError, match="disagree on their count: 2 slots, 3 positions"):
        ContextRows((torch.zeros(3),), torch.arange(3), (1, 2))
    backlog = ContextBacklog()
    backlog.hold(rows([1], 0.0))
    with pytest.raises(ValueError, match="a drafter's held rows keep one layout"):
        backlog.hold(ContextRows((torch.zeros(1, 2),), torch.arange(1), (2,)))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        ContextBacklog(max_rows=0)
