"""Steps where nobody drafts go to ``take_context``, not to an empty proposal, and change nothing else.

The oracle is the same engine with the shortcut off: every idle step then
makes its proposal of nothing, as before. Same schedule, same proposals on the
steps that draft, token for token, the same outputs; and the shortcut must be
taken (no proposal on an idle step), or the comparison says nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tests_support import perturbed_copy

from backends import create
from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter
from backends.lookup_first import LookupFirst
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import Engine, EngineConfig
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.scheduler import SchedulerConfig
from specdec.speculator import ContextTaker, DraftContext, Proposal, Speculator, TargetStep

TARGET = Transformer(ModelConfig.tiny(), seed=0)
PROMPTS = [(5, 17, 40, 8, 61, 2), (6, 17, 41, 8), (7, 3, 42, 8, 61, 2, 9, 9, 1), (8, 17)]


class DraftsEveryThird(DraftLengthPolicy):
    """Two drafts for every request on every third decision, none otherwise."""

    calls = 0

    def choose(self, req_ids: Sequence[str], *, base_rows: int, **context: object) -> dict[str, int]:
        self.calls += 1
        return dict.fromkeys(req_ids, 2 if self.calls % 3 == 0 else 0)


def speculator(kind: str) -> Speculator:
    if kind == "draft-model":  # the autoregressive backend with a separate draft model: it holds nothing
        return AutoregressiveSpeculator(ModelDrafter(perturbed_copy(TARGET, 0.3, 2)), num_spec_tokens=3, name="m")
    if kind == "dflash+lookup":
        return LookupFirst(create("dflash", TARGET, num_spec_tokens=3), min_match=2, lookup_drafts=5)
    return create(kind, TARGET, num_spec_tokens=3)


def run(
    kind: str, *, shortcut: bool, num_blocks: int, takes_nothing: bool = False
) -> tuple[list[list[int]], dict[str, list[int]], int, int]:
    """The drafts of every proposal that drafts, the outputs, the proposals and the context takes.

    ``takes_nothing``: the planted bug, a ``take_context`` that never hands the step to the drafter."""
    spec = speculator(kind)
    drafts: list[list[int]] = []
    calls = {"propose": 0, "take_context": 0}
    real_propose = spec.propose

    def propose(step: TargetStep, ctx: DraftContext) -> Proposal:
        calls["propose"] += 1
        proposal = real_propose(step, ctx)
        if any(proposal.num_drafts):
            drafts.append(proposal.draft_token_ids.flatten().tolist())
        return proposal

    spec.propose = propose  # type: ignore[method-assign]
    assert isinstance(spec, ContextTaker)
    real_take = spec.take_context

    def take_context(step: TargetStep, ctx: DraftContext) -> None:
        calls["take_context"] += 1
        if not takes_nothing:
            real_take(step, ctx)

    spec.take_context = take_context  # type: ignore[method-assign]
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=2,
        draft_length="adaptive",
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_model_len=64),
    )
    engine = Engine(TARGET, config, speculator=spec, draft_policy=DraftsEveryThird(spec.num_spec_tokens))
    if not shortcut:
        engine._context_taker = None
    reqs = [engine.add_request(f"r{i}", list(p), max_tokens=14) for i, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    return drafts, {r.req_id: list(r.output) for r in reqs}, calls["propose"], calls["take_context"]


@pytest.mark.parametrize("num_blocks", [256, 20], ids=["roomy", "preempting"])
@pytest.mark.parametrize("kind", ["eagle", "dflash", "dspark", "draft-model", "dflash+lookup"])
def test_taking_the_context_gives_the_drafts_of_an_empty_proposal(kind: str, num_blocks: int) -> None:
    proposed, out_proposed, proposals, takes_off = run(kind, shortcut=False, num_blocks=num_blocks)
    taken, out_taken, drafting_proposals, takes = run(kind, shortcut=True, num_blocks=num_blocks)
    assert out_taken == out_proposed
    assert takes_off == 0 and takes > 0, "the shortcut was not taken"
    assert drafting_proposals + takes == proposals and drafting_proposals < proposals
    assert taken == proposed, "the proposals of the drafting steps differ once the idle steps take the context"
    assert sum(d >= 0 for step in taken for d in step) > 10, "too few drafts to compare"


def test_a_drafter_that_takes_no_context_changes_the_drafts() -> None:
    """The planted bug the test above exists for: an idle step whose context never reaches the drafter."""
    proposed, *_ = run("dflash", shortcut=False, num_blocks=256)
    dropped, _, _, takes = run("dflash", shortcut=True, num_blocks=256, takes_nothing=True)
    assert takes > 0 and dropped != proposed


def test_take_context_is_refused_where_a_request_drafts() -> None:
    spec = create("dflash", TARGET, num_spec_tokens=3)
    engine = Engine(TARGET, EngineConfig(num_blocks=64, block_size=2), speculator=spec)
    engine.add_request("r", [5, 17, 40], max_tokens=4)
    engine.step()
    assert engine.draft_ctx is not None and isinstance(spec, ContextTaker)
    taken: list[TargetStep] = []
    real_take = spec.take_context
    spec.take_context = lambda step, ctx: taken.append(step) or real_take(step, ctx)  # type: ignore[method-assign]
    steps: list[TargetStep] = []
    real_propose = spec.propose

    def propose(step: TargetStep, ctx: DraftContext) -> Proposal:
        steps.append(step)
        return real_propose(step, ctx)

    spec.propose = propose  # type: ignore[method-assign]
    engine.step()
    assert steps and any(steps[-1].drafting) and not taken  # fixed K: every decoding request drafts
    with pytest.raises(ValueError, match="drafting requests \\['r'\\]"):
        engine.draft_ctx.take_context(spec, steps[-1])
