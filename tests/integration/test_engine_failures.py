"""A step that raises is undone; finished requests are released; aborted ones free everything they held.

A fault is injected into each phase of a step at a chosen call, and the run
goes on after it. The failed step must leave every request's tokens, finish
state and counts, the run's counters and the sampling generator as they were
before it, hold no KV block anywhere, and the run must then finish with the
greedy tokens of an engine that never failed: no request past ``max_tokens``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from specdec_ngram import make_speculator as make_ngram
from test_engine import PROMPTS, Req, add, assert_kv_consistent, greedy_reference, make_engine

import contracts
import specdec.engine
import specdec.speculator
from specdec.dp_group import in_process_world
from specdec.engine import Engine
from specdec.request import FinishReason, Request, RequestStatus
from specdec.sampling import SamplingParams
from specdec.speculator import Speculator
from specdec.step_undo import EngineFailedError

REQUESTS = (Req("a", PROMPTS[0], 5), Req("b", PROMPTS[1], 9), Req("c", PROMPTS[2], 7), Req("d", PROMPTS[3], 12))


def ngram(engine: Engine) -> Speculator:
    """The example n-gram drafter: no draft cache, but a token history per request it must let go of."""
    return make_ngram(engine.model, num_spec_tokens=3)


class Fault(RuntimeError):
    """The injected failure."""


@dataclass
class Injection:
    """Raise ``Fault`` from a wrapped callable once: at its ``at``-th call, or at the first call ``when`` accepts."""

    at: int | None = None
    when: Callable[[], bool] | None = None
    after: bool = True
    """Raise after the real call ran (its effects are half a step to undo), not instead of it."""
    calls: int = 0
    fired: int = 0

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if not self.after and self._due():
                self._fire()
            result = real(*args, **kwargs)
            if self.after and self._due():
                self._fire()
            return result

        return wrapper

    def _due(self) -> bool:
        if self.fired:
            return False
        if self.at is not None:
            return self.calls == self.at
        return self.when is not None and self.when()

    def _fire(self) -> None:
        self.fired += 1
        raise Fault(f"injected fault at call {self.calls}")


def finishing(engine: Engine) -> Callable[[], bool]:
    """True while a step holds a request it finished but has not retired yet: the step that must not half-happen."""
    return lambda: any(r.finish_reason is not None for r in engine.scheduler.running)


def seam_schedule(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=4)  # after the scheduler admitted, reserved blocks and (when short) preempted
    mp.setattr(engine.scheduler, "schedule", inj.wrap(engine.scheduler.schedule))
    return inj


def seam_admission(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=1)  # the first step admitted every request and reserved its blocks: none ran yet
    mp.setattr(engine.scheduler, "schedule", inj.wrap(engine.scheduler.schedule))
    return inj


def seam_dp_sync(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=4)
    mp.setattr(specdec.engine, "sync_dp", inj.wrap(specdec.engine.sync_dp))
    return inj


def seam_target_forward(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=4)  # after the forward wrote its K/V and the cache lengths were set
    mp.setattr(engine.model, "forward", inj.wrap(engine.model.forward))
    return inj


def seam_verify(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=4)  # after verification drew from the generator
    mp.setattr(specdec.engine, "verify", inj.wrap(specdec.engine.verify))
    return inj


def seam_commit(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(when=finishing(engine))  # right after a request's output reached its end
    mp.setattr(engine, "_append", inj.wrap(engine._append))
    return inj


def seam_draft_forward(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    assert engine.draft_ctx is not None
    inj = Injection(when=finishing(engine))  # a draft forward has written draft KV
    mp.setattr(engine.draft_ctx, "forward", inj.wrap(engine.draft_ctx.forward))
    return inj


def seam_draft_cache_close(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(when=finishing(engine))  # the draft cache is committed and the finished request freed in it
    mp.setattr(specdec.speculator, "close_cache", inj.wrap(specdec.speculator.close_cache))
    return inj


def seam_proposal_check(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(when=finishing(engine), after=False)
    mp.setattr(specdec.engine, "check_proposal", inj.wrap(specdec.engine.check_proposal))
    return inj


def seam_finish(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=1)  # the scheduler freed the finished request's KV; the drafter has not let go of it yet
    mp.setattr(engine.scheduler, "finish", inj.wrap(engine.scheduler.finish))
    return inj


def seam_counting(engine: Engine, mp: pytest.MonkeyPatch) -> Injection:
    inj = Injection(at=1)  # a finished request's counts joined the run's: only an interrupt can land here
    mp.setattr(engine.metrics, "add_request", inj.wrap(engine.metrics.add_request))
    return inj


SEAMS: dict[str, tuple[Callable[[Engine, pytest.MonkeyPatch], Injection], str]] = {
    "admission": (seam_admission, "schedule"),
    "schedule": (seam_schedule, "schedule"),
    "dp-sync": (seam_dp_sync, "DP sync"),
    "target-forward": (seam_target_forward, "target forward"),
    "verify": (seam_verify, "verify"),
    "commit": (seam_commit, "commit"),
    "draft-forward": (seam_draft_forward, "propose"),
    "draft-cache-close": (seam_draft_cache_close, "propose"),
    "proposal-check": (seam_proposal_check, "propose"),
    "finish": (seam_finish, "finish"),
    "counting": (seam_counting, "finish"),
}
DRAFT_SEAMS = {"draft-forward", "draft-cache-close", "proposal-check"}


@dataclass(frozen=True)
class Visible:
    """What a caller can see of the engine between steps."""

    outputs: dict[str, list[int]]
    finish: dict[str, FinishReason | None]
    request_counts: dict[str, dict[str, Any]]
    run_counts: dict[str, Any]
    steps: tuple[int, int, int]
    generator: torch.Tensor

    @staticmethod
    def of(engine: Engine) -> Visible:
        live = engine.requests.values()
        m = engine.metrics
        return Visible(
            {r.req_id: list(r.output) for r in live},
            {r.req_id: r.finish_reason for r in live},
            {r.req_id: {**r.metrics.counts(), "preemptions": r.metrics.preemptions} for r in live},
            m.counts(),
            (m.steps, m.tokens_emitted, m.tokens_scheduled),
            engine.generator.get_state(),
        )

    def assert_same(self, other: Visible) -> None:
        assert other.outputs == self.outputs, "the failed step's tokens stayed in the outputs"
        assert other.finish == self.finish, "the failed step's finish states stayed"
        assert other.request_counts == self.request_counts, "the failed step's speculation counts stayed"
        assert other.run_counts == self.run_counts and other.steps == self.steps, "the run's counters moved"
        assert torch.equal(other.generator, self.generator), "the sampling generator was not restored"


def assert_nothing_held(engine: Engine) -> None:
    """After an undo every unfinished request waits, holding no block of any cache."""
    assert engine.scheduler.running == []
    assert {r.req_id for r in engine.scheduler.waiting} == set(engine.requests)
    for req in engine.scheduler.waiting:
        assert req.status is RequestStatus.WAITING and req.num_computed == 0 and req.drafts == []
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "target blocks still held after the undo"
    if engine.draft_ctx is not None:
        for name, cache in engine.draft_ctx.caches.items():
            assert cache.num_free_blocks == cache.num_blocks, f"draft cache {name!r} still holds blocks"
            assert cache.requests == (), f"draft cache {name!r} still tracks {cache.requests}"
    tracked = getattr(engine.speculator, "tracked_requests", None)  # the n-gram drafter's own state
    assert not tracked, f"the drafter still holds state for {tracked}"


CASES = [
    *((seam, cache, "perturbed") for seam in SEAMS for cache in ("roomy", "preempting")),
    *((seam, "roomy", "none") for seam in SEAMS if seam not in DRAFT_SEAMS),
    *((seam, "roomy", "ngram") for seam in ("commit", "proposal-check")),  # a drafter with non-cache state
]


@pytest.mark.parametrize(("seam", "cache", "speculator"), CASES)
def test_a_step_that_raises_in_any_phase_is_undone_and_the_run_ends_as_if_it_never_failed(
    seam: str, cache: str, speculator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = {"roomy": 256, "preempting": 14}[cache]
    engine = make_engine(speculator=speculator, k=3, num_blocks=blocks, block_size=2, budget=32)
    if speculator == "ngram":
        engine = Engine(engine.model, engine.config, speculator=ngram(engine))
    added = {r.req_id: add(engine, r) for r in REQUESTS}
    inject, phase = SEAMS[seam]
    injection = inject(engine, monkeypatch)
    finished: dict[str, Request] = {}
    with contracts.enforce("full"):
        for _ in range(300):
            if not engine.has_work:
                break
            before = Visible.of(engine)
            try:
                result = engine.step()
            except Fault as exc:
                notes = "\n".join(getattr(exc, "__notes__", []))
                assert f"failed in its {phase} phase and was undone" in notes
                before.assert_same(Visible.of(engine))
                assert_nothing_held(engine)
                continue
            finished.update(result.finished)
            assert_kv_consistent(engine, result)
            for req in added.values():
                assert len(req.output) <= req.max_tokens, f"{req.req_id} went past max_tokens"
    assert injection.fired == 1, f"the {seam} fault never fired: the test did not test it"
    assert not engine.has_work and engine.requests == {}
    assert set(finished) == set(added)
    assert {rid: r.output for rid, r in added.items()} == greedy_reference(0, REQUESTS)
    assert all(r.finish_reason is FinishReason.MAX_TOKENS and len(r.output) == r.max_tokens for r in added.values())
    m = engine.metrics
    assert m.tokens_emitted == sum(len(r.output) for r in added.values()), "a failed step's tokens were counted"
    assert m.drafted == sum(r.metrics.drafted for r in added.values())
    assert m.accepted == sum(r.metrics.accepted for r in added.values())
    if cache == "preempting":
        assert any(r.metrics.preemptions for r in added.values()), "the cache was sized to preempt"


def test_a_failed_step_under_sampling_puts_the_generator_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier drew from the engine's stream before the fault; the undo rewinds it."""
    engine = make_engine(speculator="eagle", k=3)
    engine.add_request("s", list(PROMPTS[0]), params=SamplingParams(temperature=1.0), max_tokens=8)
    injection = seam_verify(engine, monkeypatch)
    state = None
    while engine.has_work:
        state = engine.generator.get_state()
        try:
            engine.step()
        except Fault:
            assert torch.equal(engine.generator.get_state(), state)
    assert injection.fired == 1 and state is not None


def test_an_undo_that_fails_makes_the_engine_refuse_to_step(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(speculator="perturbed", k=3)
    added = {r.req_id: add(engine, r) for r in REQUESTS}
    seam_proposal_check(engine, monkeypatch)
    assert engine.speculator is not None

    def broken_finish(req_id: str) -> None:
        raise KeyError(f"drafter lost track of {req_id}")

    monkeypatch.setattr(engine.speculator, "finish", broken_finish)
    with pytest.raises(Fault) as info:
        while engine.has_work:
            engine.step()
    assert "undoing it failed too" in "\n".join(info.value.__notes__)
    for refused in (engine.step, lambda: engine.add_request("z", [1, 2], max_tokens=2), lambda: engine.abort("a")):
        with pytest.raises(EngineFailedError, match=r"failed in its propose phase \(Fault: injected") as refusal:
            refused()
        assert "undoing it failed too (KeyError" in str(refusal.value)
        assert "Build a new Engine" in str(refusal.value)
        assert refusal.value.__cause__ is info.value
    assert set(engine.requests) == set(added) - {r for r, q in added.items() if q.finished}


def test_a_dp_rank_whose_step_failed_refuses_to_step_but_can_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers cannot undo their part of the step: the rank undoes its own and refuses further steps."""
    (group,) = in_process_world(1, timeout_s=5.0)
    plain = make_engine()
    engine = Engine(plain.model, plain.config, dp_group=group)
    added = {r.req_id: add(engine, r) for r in REQUESTS}
    seam_verify(engine, monkeypatch)
    before: Visible | None = None
    with pytest.raises(Fault) as info:
        while engine.has_work:
            before = Visible.of(engine)
            engine.step()
    assert before is not None
    before.assert_same(Visible.of(engine))
    assert_nothing_held(engine)
    assert "on DP rank 0" in "\n".join(info.value.__notes__)
    with pytest.raises(EngineFailedError, match=r"step \d+ failed in its verify phase on DP rank 0 \(Fault") as refusal:
        engine.step()
    assert "build a new DP group and a new engine on every rank" in str(refusal.value)
    for rid, req in added.items():
        assert engine.abort(rid) is req and req.output == before.outputs[rid]
        assert req.finish_reason is FinishReason.ABORTED
    assert engine.requests == {} and engine.kv.requests == ()


@pytest.mark.parametrize("speculator", ["perturbed", "ngram"])
def test_abort_frees_every_block_and_the_drafter_state_and_leaves_the_others_exact(speculator: str) -> None:
    """A running request with drafts in flight and a waiting one are aborted; the rest decode as if alone."""
    engine = make_engine(speculator="perturbed" if speculator == "perturbed" else "none", k=3, max_num_seqs=4)
    if speculator == "ngram":
        engine = Engine(engine.model, engine.config, speculator=ngram(engine))
    added = {r.req_id: add(engine, r) for r in REQUESTS}
    late = add(engine, Req("late", PROMPTS[4], 6))  # max_num_seqs=4: it waits
    engine.step()
    engine.step()
    running = added["b"]
    assert running.status is RequestStatus.RUNNING and running.output, "b should be decoding"
    if speculator == "ngram":
        assert "b" in engine.speculator.tracked_requests  # type: ignore[union-attr]
    else:
        assert running.drafts, "b should have drafts in flight"
    tokens = list(running.output)
    assert engine.abort("b") is running
    assert running.output == tokens and running.finish_reason is FinishReason.ABORTED and running.drafts == []
    assert "b" not in engine.requests and "b" not in engine.kv and "b" in engine.kv.finished_requests
    assert engine.draft_ctx is not None
    for cache in engine.draft_ctx.caches.values():
        assert "b" not in cache.requests
    if speculator == "ngram":
        assert "b" not in engine.speculator.tracked_requests  # type: ignore[union-attr]
    assert late.status is RequestStatus.WAITING
    assert engine.abort("late") is late and late.output == [] and "late" not in engine.kv
    with pytest.raises(ValueError, match=r"no unfinished request 'b' to abort.*holds \['a', 'c', 'd'\]"):
        engine.abort("b")
    with contracts.enforce("full"):
        outputs = engine.run()
    rest = tuple(r for r in REQUESTS if r.req_id != "b")
    assert outputs == greedy_reference(0, rest)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for cache in engine.draft_ctx.caches.values():
        assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("speculator", ["none", "perturbed"])
def test_finished_requests_are_released_once_reported(speculator: str) -> None:
    """The engine shrinks as requests finish and, after the run, holds no reference to any of them."""
    engine = make_engine(speculator=speculator, k=3)
    refs: list[weakref.ref[Request]] = []
    for wave in range(2):
        requests = tuple(Req(f"w{wave}-{i}", PROMPTS[i], 3 + i) for i in range(5))
        for r in requests:
            refs.append(weakref.ref(add(engine, r)))
        live = {r.req_id for r in requests}
        while engine.has_work:
            result = engine.step()
            live -= set(result.finished)
            assert set(engine.requests) == live, "a reported request is still held, or an unreported one is gone"
            del result
        assert engine.kv.requests == () and engine.scheduler.running == [] and not engine.scheduler.waiting
    gc.collect()
    alive = [ref().req_id for ref in refs if ref() is not None]  # type: ignore[union-attr]
    assert alive == [], f"the engine still references finished requests {alive}"
    assert len(engine.kv.finished_requests) == len(refs)  # ids only, and bounded by the cache's history


def test_run_returns_the_requests_it_finished_in_the_order_they_were_added() -> None:
    engine = make_engine(speculator="perturbed", k=3)
    for r in reversed(REQUESTS):  # the longest first: they finish in another order than they were added
        add(engine, r)
    outputs = engine.run()
    assert list(outputs) == [r.req_id for r in reversed(REQUESTS)]
    assert outputs == greedy_reference(0, REQUESTS)
    assert engine.requests == {}
