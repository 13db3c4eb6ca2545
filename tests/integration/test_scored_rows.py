"""Draft forwards score only the rows their drafter samples: EAGLE's prefill pays the LM head at each drafting
request's last row, and nothing at a step where no request drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from backends.autoregressive import AutoregressiveSpeculator, EagleHead, ModelDrafter
from backends.registry import spread_layers
from contracts import StepKind
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import DraftContext, DraftOutput

FIXED = EngineConfig(num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96))
ADAPTIVE = EngineConfig(
    num_blocks=256, block_size=4, scheduler=SchedulerConfig(max_model_len=96), draft_length="adaptive"
)
PROMPTS = [(3, 17, 40), (5, 9), (11, 12, 13, 14)]


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(ModelConfig.tiny(), seed=0)


class EveryThirdDecision(DraftLengthPolicy):
    """By turn: no request drafts, every other request drafts two tokens, every request does."""

    calls = 0

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        self.calls += 1
        turn = self.calls % 3
        return {r: 0 if turn == 0 or (turn == 1 and i % 2) else 2 for i, r in enumerate(req_ids)}


def eagle(target: Transformer) -> AutoregressiveSpeculator:
    aux = spread_layers(target.config.num_layers)
    head = EagleHead(target, num_aux=len(aux), seed=3)
    return AutoregressiveSpeculator(head, num_spec_tokens=3, aux_layers=aux, name="eagle")


def prefills(
    monkeypatch: pytest.MonkeyPatch, expected: list[tuple[int, ...]] | None = None
) -> list[tuple[tuple[int, ...], tuple[int, ...] | None, int]]:
    """Every draft prefill: the rows its drafter must sample, the rows it asked to score, and its logits rows.

    ``expected`` collects the rows to sample of every proposal, forward or not (none for a step that only takes
    in its context)."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...] | None, int]] = []
    real_propose = AutoregressiveSpeculator.propose
    real_forward = DraftContext.forward
    expected = [] if expected is None else expected

    def propose(self: AutoregressiveSpeculator, step: Any, ctx: DraftContext) -> Any:
        expected.append(tuple(step.last_valid[r] for r in range(step.num_reqs) if step.drafting[r]))
        return real_propose(self, step, ctx)

    real_take = AutoregressiveSpeculator.take_context

    def take_context(self: AutoregressiveSpeculator, step: Any, ctx: DraftContext) -> None:
        expected.append(())  # a step where nobody drafts: no proposal, nothing to sample
        real_take(self, step, ctx)

    def forward(self: DraftContext, model: Any, step_kind: StepKind, *args: Any, **kw: Any) -> DraftOutput:
        out = real_forward(self, model, step_kind, *args, **kw)
        if step_kind is StepKind.DRAFT_PREFILL:
            seen.append((expected[-1], kw.get("scored_rows"), out.logits.shape[0]))
        return out

    monkeypatch.setattr(AutoregressiveSpeculator, "propose", propose)
    monkeypatch.setattr(AutoregressiveSpeculator, "take_context", take_context)
    monkeypatch.setattr(DraftContext, "forward", forward)
    return seen


def decode(engine: Engine) -> list[list[int]]:
    reqs = [engine.add_request(f"q{i}", p, max_tokens=24) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    return [list(r.output) for r in reqs]


def test_eagle_prefill_scores_each_drafting_requests_last_row_and_runs_no_forward_when_none_drafts(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step where no request drafts only holds its context (test_context_backlog): no prefill forward at all."""
    proposals: list[tuple[int, ...]] = []
    seen = prefills(monkeypatch, proposals)
    plain = decode(Engine(target, FIXED))
    outputs = decode(Engine(target, ADAPTIVE, speculator=eagle(target), draft_policy=EveryThirdDecision(3)))
    assert outputs == plain
    for drafting_rows, scored, logit_rows in seen:
        assert drafting_rows and scored == drafting_rows
        assert logit_rows == len(drafting_rows)
    assert len(seen) == sum(1 for rows in proposals if rows)
    assert any(not rows for rows in proposals), "no step without drafting: the idle case went untested"
    assert any(len(rows) >= 2 for rows, _, _ in seen), "no step with several drafting requests"


def test_a_draft_model_scores_no_prefill_row(target: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A separate draft model starts from the bonus token: its prefill only writes its cache."""
    seen = prefills(monkeypatch)
    spec = AutoregressiveSpeculator(ModelDrafter(target), num_spec_tokens=3, name="self")
    decode(Engine(target, ADAPTIVE, speculator=spec, draft_policy=EveryThirdDecision(3)))
    assert seen and all(scored == () and logit_rows == 0 for _, scored, logit_rows in seen)


def drafts_of(target: Transformer, monkeypatch: pytest.MonkeyPatch, *, score_every_row: bool) -> list[list[int]]:
    """Every proposal's draft ids; ``score_every_row`` makes each forward score all rows and pick the asked ones."""
    drafts: list[list[int]] = []
    real_propose = AutoregressiveSpeculator.propose
    real_forward = DraftContext.forward

    def propose(self: AutoregressiveSpeculator, step: Any, ctx: DraftContext) -> Any:
        proposal = real_propose(self, step, ctx)
        drafts.append(proposal.draft_token_ids.flatten().tolist())
        return proposal

    def forward(self: DraftContext, model: Any, step_kind: StepKind, *args: Any, **kw: Any) -> DraftOutput:
        rows = kw.pop("scored_rows", None)
        out = real_forward(self, model, step_kind, *args, **kw)
        return out if rows is None else DraftOutput(out.hidden_states[list(rows)], out.logits[list(rows)])

    with monkeypatch.context() as patch:
        patch.setattr(AutoregressiveSpeculator, "propose", propose)
        if score_every_row:
            patch.setattr(DraftContext, "forward", forward)
        decode(Engine(target, FIXED, speculator=eagle(target)))
    return drafts


def test_eagles_drafts_are_those_it_drew_when_every_row_was_scored(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scored = drafts_of(target, monkeypatch, score_every_row=False)
    every = drafts_of(target, monkeypatch, score_every_row=True)
    assert len(scored) > 10 and scored == every
