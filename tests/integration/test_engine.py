"""The engine and scheduler end to end: KV accounting, stop conditions, input errors, metrics, batching.

Speculation, chunked prefill and preemption are all allowed to change *when*
tokens are computed but never *which* tokens come out: every greedy run here is
compared token for token with plain greedy decoding of the same requests on a
cache big enough that nothing is ever preempted. Tiny random targets keep the
whole file to seconds on a CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import contracts
from backends import create
from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter
from specdec.engine import Engine, EngineConfig, StepResult
from specdec.kv_cache import KVCacheManager, blocks_for
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.request import FinishReason, Request, RequestStatus
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

TARGET = ModelConfig.tiny()
VOCAB = TARGET.vocab_size
MAX_MODEL_LEN = 64
SPECULATORS = ("none", "self", "perturbed", "eagle", "draft-model")


@dataclass(frozen=True)
class Req:
    """A request as the tests describe it: plain data, hashable, so references can be cached."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()


# -- builders ----------------------------------------------------------------------------------------


@functools.cache
def target_model(seed: int) -> Transformer:
    """Targets are stateless between forwards (KV lives in each engine), so one per seed is shared."""
    return Transformer(TARGET, seed=seed)


@functools.cache
def perturbed_model(seed: int) -> Transformer:
    """The target with noise on its weights: agrees with it often, not always (partial acceptance)."""
    copy = Transformer(TARGET, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.6 * p.abs().mean())
    return copy


def make_speculator(kind: str, target: Transformer, k: int) -> Speculator | None:
    """Drafters that never (eagle, draft-model), sometimes (perturbed) and always (self) agree with the target."""
    if kind == "none":
        return None
    if kind == "self":
        return AutoregressiveSpeculator(ModelDrafter(target), num_spec_tokens=k, name="self")
    if kind == "perturbed":
        return AutoregressiveSpeculator(ModelDrafter(perturbed_model(target.seed)), num_spec_tokens=k, name="perturbed")
    return create(kind, target, num_spec_tokens=k)


def make_engine(
    *,
    seed: int = 0,
    speculator: str = "none",
    k: int = 4,
    num_blocks: int = 256,
    block_size: int = 4,
    budget: int = 256,
    max_num_seqs: int = 64,
    max_model_len: int = MAX_MODEL_LEN,
) -> Engine:
    target = target_model(seed)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len
        ),
    )
    return Engine(target, config, speculator=make_speculator(speculator, target, k))


def add(engine: Engine, req: Req) -> Request:
    """Add ``req``; the returned ``Request`` outlives the engine's hold on it (released once finished)."""
    return engine.add_request(
        req.req_id, list(req.prompt), max_tokens=req.max_tokens, stop_token_ids=req.stop_token_ids
    )


@functools.cache
def greedy_reference(seed: int, requests: tuple[Req, ...], max_model_len: int = MAX_MODEL_LEN) -> dict[str, list[int]]:
    """Plain greedy decoding on a cache and budget so large that nothing is chunked or preempted."""
    engine = make_engine(seed=seed, num_blocks=1024, block_size=4, budget=4096, max_model_len=max_model_len)
    for r in requests:
        add(engine, r)
    return engine.run()


def run_steps(engine: Engine, check: Callable[[Engine, StepResult], None] | None = None) -> list[StepResult]:
    """Step to completion, calling ``check`` after every step."""
    results: list[StepResult] = []
    for _ in range(2000):
        if not engine.has_work:
            return results
        result = engine.step()
        results.append(result)
        if check is not None:
            check(engine, result)
    raise AssertionError("engine did not finish within 2000 steps")


# -- 1. KV accounting under preemption ---------------------------------------------------------------


def assert_cache_balanced(cache: KVCacheManager, label: str) -> None:
    """KV-1 by the invariant itself and recomputed by hand from a facts snapshot."""
    cache.check()
    facts = cache.facts()
    held = [b for table in facts.block_tables.values() for b in table]
    assert len(held) + len(facts.free_blocks) == facts.num_blocks_total, label
    assert len(set(held) | set(facts.free_blocks)) == facts.num_blocks_total, f"{label}: a block is booked twice"
    assert not any(facts.block_tables.get(r) for r in facts.finished_requests), label


def assert_kv_consistent(engine: Engine, _: StepResult | None = None) -> None:
    """Target and draft caches after a step: balanced (KV-1), committed lengths exact (KV-2), no leaks."""
    kv, sched = engine.kv, engine.scheduler
    assert_cache_balanced(kv, "target cache")
    running = {r.req_id for r in sched.running}
    waiting = {r.req_id for r in sched.waiting}
    assert not running & waiting
    assert set(kv.requests) == running | waiting, "the target cache tracks exactly the unfinished requests"
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert kv.length(req.req_id) == req.num_computed, f"KV-2: {req.req_id} cached != computed"
        assert kv.capacity(req.req_id) >= req.num_computed
        assert len(kv.block_table(req.req_id)) == blocks_for(req.num_computed, kv.block_size), "over-allocated"
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING
        assert req.num_computed == 0 and kv.length(req.req_id) == 0 and kv.block_table(req.req_id) == []
    held = sum(len(kv.block_table(r)) for r in kv.requests)
    assert held + kv.num_free_blocks == kv.num_blocks
    assert set(engine.requests) == running | waiting, "the engine holds exactly its unfinished requests"
    assert not any(req.finished for req in engine.requests.values()), "a finished request is released once reported"
    if engine.draft_ctx is not None:
        for name, cache in engine.draft_ctx.caches.items():
            assert_cache_balanced(cache, f"draft cache {name!r}")
            assert set(cache.requests) <= running, f"draft cache {name!r} holds state of a non-running request"


@dataclass(frozen=True)
class KVCase:
    """One randomized run: engine settings, requests present at the start and ``(step, request)`` added later."""

    seed: int
    speculator: str
    k: int
    num_blocks: int
    block_size: int
    budget: int
    max_num_seqs: int
    initial: tuple[Req, ...]
    later: tuple[tuple[int, Req], ...]

    def engine(self) -> Engine:
        return make_engine(
            seed=self.seed,
            speculator=self.speculator,
            k=self.k,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            budget=self.budget,
            max_num_seqs=self.max_num_seqs,
        )


@st.composite
def kv_cases(draw: st.DrawFn) -> KVCase:
    """A drafter or none, requests at the start and some added mid-run, and a cache that barely fits the largest.

    The cache is sized from the requests (the largest one's worst case plus a
    few blocks) rather than drawn blindly, so that long requests running
    together usually have to preempt.
    """
    speculator = draw(st.sampled_from(SPECULATORS))
    k = draw(st.integers(1, 4))
    block_size = draw(st.integers(2, 4))
    headroom = k + 1 if speculator != "none" else 1

    def request(name: str) -> Req:
        prompt = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)))
        return Req(name, prompt, draw(st.integers(1, 14)))

    initial = tuple(request(f"a{i}") for i in range(draw(st.integers(2, 4))))
    later = tuple((draw(st.integers(0, 8)), request(f"b{i}")) for i in range(draw(st.integers(0, 2))))
    everything = [*initial, *(r for _, r in later)]
    largest = max(blocks_for(len(r.prompt) + r.max_tokens + headroom, block_size) for r in everything)
    return KVCase(
        seed=draw(st.integers(0, 1)),
        speculator=speculator,
        k=k,
        num_blocks=largest + draw(st.integers(0, 6)),
        block_size=block_size,
        budget=draw(st.integers(4, 32)),
        max_num_seqs=draw(st.integers(2, 8)),
        initial=initial,
        later=later,
    )


@settings(max_examples=12)
@given(kv_cases())
def test_kv_accounting_holds_after_every_step_of_long_randomized_runs(case: KVCase) -> None:
    """Preemption, recompute, chunking and rollback must never lose, leak or double-book a block."""
    engine = case.engine()
    with contracts.enforce("full"):
        added = {r.req_id: add(engine, r) for r in case.initial}
        pending = sorted(case.later, key=lambda x: x[0])
        step = 0
        while engine.has_work or pending:
            while pending and (pending[0][0] <= step or not engine.has_work):
                later = pending.pop(0)[1]
                added[later.req_id] = add(engine, later)
            scheduled_before = engine.metrics.tokens_scheduled
            engine.step()
            step += 1
            assert step < 2000, "engine did not finish"
            assert engine.metrics.tokens_scheduled - scheduled_before <= case.budget
            assert len(engine.scheduler.running) <= case.max_num_seqs
            assert_kv_consistent(engine)
    everything = (*case.initial, *(r for _, r in case.later))
    assert all(added[r.req_id].finished for r in everything) and not engine.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    outputs = {rid: req.output for rid, req in added.items()}
    assert outputs == greedy_reference(case.seed, everything)
    preemptions = sum(req.metrics.preemptions for req in added.values())
    event("preempted" if preemptions else "not preempted")


@pytest.mark.parametrize("speculator", ["none", "self", "eagle"])
def test_preemption_happens_under_pressure_and_keeps_greedy_output(speculator: str) -> None:
    """Four long requests on a cache that holds barely one: preemption must happen, and must be invisible."""
    requests = tuple(Req(f"p{i}", (5 + i, 17, 40 + i, 8, 61, 2), 12) for i in range(4))
    engine = make_engine(speculator=speculator, k=3, num_blocks=12, block_size=2, budget=32)
    added = {r.req_id: add(engine, r) for r in requests}
    with contracts.enforce("full"):
        run_steps(engine, assert_kv_consistent)
    preempted = [req for req in added.values() if req.metrics.preemptions > 0]
    assert preempted, "the cache was sized so that preemption must happen"
    assert all(req.finish_reason is FinishReason.MAX_TOKENS for req in added.values())
    assert {rid: req.output for rid, req in added.items()} == greedy_reference(0, requests)
    if engine.draft_ctx is not None:
        for cache in engine.draft_ctx.caches.values():
            assert cache.num_free_blocks == cache.num_blocks, "draft blocks leaked past the end of the run"


# -- 2. stop conditions ------------------------------------------------------------------------------


PROMPTS = [(3 + i, 17, 40 + i, 9, 2 * i + 1) for i in range(6)]


@settings(max_examples=6)
@given(
    max_tokens=st.integers(1, 14),
    k=st.integers(1, 5),
    speculator=st.sampled_from(["none", "self"]),
    prompt=st.sampled_from(PROMPTS),
)
def test_max_tokens_is_respected_exactly(max_tokens: int, k: int, speculator: str, prompt: tuple[int, ...]) -> None:
    """A verify step may emit up to K+1 tokens; the output is cut at max_tokens all the same."""
    engine = make_engine(speculator=speculator, k=k)
    req = add(engine, Req("r", prompt, max_tokens))
    engine.run()
    assert len(req.output) == max_tokens
    assert req.finish_reason is FinishReason.MAX_TOKENS
    assert req.output == greedy_reference(0, (Req("r", prompt, 20),))["r"][:max_tokens]


def test_max_tokens_cuts_a_multi_token_verify() -> None:
    """With the target as its own drafter a verify emits up to K+1; max_tokens lands inside such a run."""
    k, max_tokens = 4, 4
    engine = make_engine(speculator="self", k=k)
    req = add(engine, Req("r", PROMPTS[0], max_tokens))
    results = run_steps(engine)
    m = req.metrics
    assert m.accepted + m.verify_steps > len(req.output) - 1, "the last verify accepted more than fit"
    assert m.emitted_in_verify == len(req.output) - 1, "tau counts only tokens that reached the output"
    assert len(results[-1].emitted["r"]) > 1, "the cut happened inside a multi-token verify"
    assert len(req.output) == max_tokens
    assert req.finish_reason is FinishReason.MAX_TOKENS
    assert req.output == greedy_reference(0, (Req("r", PROMPTS[0], 20),))["r"][:max_tokens]


@functools.cache
def self_draft_runs(prompt: tuple[int, ...], k: int) -> tuple[tuple[int, ...], ...]:
    """What each step emits for a self-drafted request that never stops early (its verify runs)."""
    engine = make_engine(speculator="self", k=k)
    add(engine, Req("r", prompt, 40))
    return tuple(tuple(result.emitted.get("r", ())) for result in run_steps(engine))


def stop_inside_run(prompt: tuple[int, ...], k: int) -> int | None:
    """Output index of a token that first occurs strictly inside a multi-token verify run (not its last)."""
    runs = self_draft_runs(prompt, k)[:-1]  # the last step may be cut at max_tokens
    output: list[int] = []
    for run in runs:
        for j, token in enumerate(run):
            if j < len(run) - 1 and token not in output:
                return len(output)
            output.append(token)
    return None


@pytest.mark.parametrize("k", [3, 5])
def test_stop_token_inside_an_accepted_draft_run_ends_the_request(k: int) -> None:
    """The stop token is the last emitted token even when verification accepted drafts beyond it."""
    for prompt in PROMPTS:
        stop_at = stop_inside_run(prompt, k)
        if stop_at is not None:
            break
    else:
        pytest.fail("no prompt's output has a fresh token inside a verify run")
    greedy = greedy_reference(0, (Req("r", prompt, 40),))["r"]
    engine = make_engine(speculator="self", k=k)
    req = add(engine, Req("r", prompt, 40, stop_token_ids=(greedy[stop_at],)))
    engine.run()
    assert req.finish_reason is FinishReason.STOP_TOKEN
    assert req.output == greedy[: stop_at + 1]
    assert req.output[-1] == greedy[stop_at]
    assert req.metrics.accepted == req.metrics.drafted, "the self drafter's runs are fully accepted"
    m = req.metrics
    assert m.accepted + m.verify_steps > len(req.output) - 1, "tokens after the stop token were verified too"
    assert m.emitted_in_verify == len(req.output) - 1, "tau counts only tokens that reached the output"


@settings(max_examples=8)
@given(
    prompt=st.sampled_from(PROMPTS),
    index=st.integers(0, 19),
    k=st.integers(1, 5),
    speculator=st.sampled_from(["none", "self", "eagle", "perturbed"]),
)
def test_stop_token_ends_at_its_first_occurrence(prompt: tuple[int, ...], index: int, k: int, speculator: str) -> None:
    """Any greedy token used as stop token cuts the output right after its first occurrence."""
    greedy = greedy_reference(0, (Req("r", prompt, 20),))["r"]
    stop = greedy[index]
    first = greedy.index(stop)
    engine = make_engine(speculator=speculator, k=k)
    req = add(engine, Req("r", prompt, 20, stop_token_ids=(stop,)))
    engine.run()
    assert req.output == greedy[: first + 1]
    assert req.output[-1] == stop
    assert req.finish_reason is FinishReason.STOP_TOKEN


@pytest.mark.parametrize("speculator", ["none", "self", "eagle"])
def test_max_model_len_ends_a_request(speculator: str) -> None:
    """Prompt plus output never exceeds max_model_len; the request ends with MAX_MODEL_LEN."""
    limit, prompt = 16, PROMPTS[1]
    engine = make_engine(speculator=speculator, k=4, max_model_len=limit)
    req = add(engine, Req("r", prompt, 40))
    with contracts.enforce("full"):
        run_steps(engine, assert_kv_consistent)
    assert req.finish_reason is FinishReason.MAX_MODEL_LEN
    assert req.num_tokens == limit
    assert req.output == greedy_reference(0, (Req("r", prompt, 40),))["r"][: limit - len(prompt)]


# -- 3. bad input --------------------------------------------------------------------------------------


def test_bad_requests_are_rejected_with_clear_errors_and_leave_no_trace() -> None:
    """Each rejected request names the problem, and the engine stays usable with the same id."""
    engine = make_engine(num_blocks=8, block_size=2)  # 16 tokens of KV
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("x", [], max_tokens=2)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 96\)"):
        engine.add_request("x", [1, VOCAB, 2], max_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [-1], max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.add_request("x", [1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.add_request("x", [1, 2], max_tokens=-3)
    with pytest.raises(ValueError, match=r"blocks.*cache has 8 blocks"):
        engine.add_request("x", [1, 2, 3], max_tokens=20)
    assert "x" not in engine.requests and "x" not in engine.kv and not engine.has_work
    engine.add_request("x", [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError, match="already in use by an unfinished request"):
        engine.add_request("x", [4, 5], max_tokens=2)
    assert engine.requests["x"].prompt == [1, 2, 3]
    assert engine.run() == {"x": greedy_reference(0, (Req("x", (1, 2, 3), 4),))["x"]}
    assert engine.run() == {}  # the finished request was reported once and released: its id is free again
    engine.add_request("x", [4, 5], max_tokens=2)
    assert engine.run() == {"x": greedy_reference(0, (Req("x", (4, 5), 2),))["x"]}


def test_prompt_at_max_model_len_is_rejected() -> None:
    """A prompt that fills max_model_len leaves no room for even one output token."""
    engine = make_engine(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        engine.add_request("x", list(range(8)), max_tokens=1)
    assert "x" not in engine.kv


def test_kv_size_check_counts_the_speculative_headroom() -> None:
    """A request fits without drafts but not with K+1 speculative slots: the error says so in blocks."""
    plain = make_engine(num_blocks=5, block_size=2)
    plain.add_request("x", [1, 2, 3], max_tokens=6)  # needs 3 + 6 + 1 = 10 tokens = 5 blocks
    spec = make_engine(speculator="self", k=2, num_blocks=5, block_size=2)
    with pytest.raises(ValueError, match=r"\(6 blocks\) but the cache has 5 blocks"):
        spec.add_request("x", [1, 2, 3], max_tokens=6)


@pytest.mark.parametrize("k", [0, 9, -1])
def test_num_spec_tokens_outside_1_to_8_is_rejected(k: int) -> None:
    """K is bounded where the speculator is built, whichever way it is built."""
    target = target_model(0)
    with pytest.raises(ValueError, match=r"num_spec_tokens \(K\) must be in 1\.\.8"):
        AutoregressiveSpeculator(ModelDrafter(target), num_spec_tokens=k)
    with pytest.raises(ValueError, match=r"must be in 1\.\.8"):
        create("eagle", target, num_spec_tokens=k)
    with pytest.raises(ValueError, match=r"must be in 1\.\.8"):
        create("draft-model", target, num_spec_tokens=k)


@pytest.mark.parametrize("k", [1, 8])
def test_num_spec_tokens_at_the_bounds_is_accepted(k: int) -> None:
    assert AutoregressiveSpeculator(ModelDrafter(target_model(0)), num_spec_tokens=k).num_spec_tokens == k


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'hydra'; known backends: \[.*'eagle'.*\]"):
        create("hydra", target_model(0))


# -- 4. metrics ----------------------------------------------------------------------------------------


def test_plain_decoding_emits_one_token_per_running_request_per_step() -> None:
    """Without a speculator every step is a decode step (or a whole-prompt prefill) emitting exactly one token."""
    n, max_tokens = 3, 9
    requests = tuple(Req(f"d{i}", PROMPTS[i], max_tokens) for i in range(n))
    engine = make_engine()
    added = {r.req_id: add(engine, r) for r in requests}

    def one_each(e: Engine, result: StepResult) -> None:
        assert sorted(result.emitted) == sorted(r.req_id for r in requests)
        assert all(len(tokens) == 1 for tokens in result.emitted.values())

    run_steps(engine, one_each)
    m = engine.metrics
    assert m.steps == max_tokens
    assert m.tokens_per_step == n
    assert m.tokens_emitted == n * max_tokens
    assert m.drafted == m.accepted == m.verify_steps == 0
    assert m.acceptance_rate_by_position == []
    assert {rid: r.output for rid, r in added.items()} == greedy_reference(0, requests)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_drafting_accepts_every_draft(k: int) -> None:
    """The target as its own drafter: every draft is accepted, at every position."""
    requests = tuple(Req(f"s{i}", PROMPTS[i], 14) for i in range(3))
    engine = make_engine(speculator="self", k=k)
    added = [add(engine, r) for r in requests]
    assert engine.run() == greedy_reference(0, requests)
    for req in added:
        assert req.metrics.accepted == req.metrics.drafted > 0
        assert len(req.metrics.drafted_by_position) == k
    m = engine.metrics
    assert m.accepted == m.drafted > 0
    assert m.acceptance_rate_by_position == [1.0] * k
    assert m.acceptance_length > 1.0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_drafting_acceptance_length_is_k_plus_one(k: int) -> None:
    """With enough tokens every verify of a self-drafted request carries K drafts and emits K+1 tokens."""
    rounds = 3
    requests = tuple(Req(f"s{i}", PROMPTS[i], 1 + rounds * (k + 1)) for i in range(3))
    engine = make_engine(speculator="self", k=k)
    added = [add(engine, r) for r in requests]
    first = engine.step()  # whole prompts: every request samples its first token ...
    assert sorted(first.emitted) == sorted(r.req_id for r in requests)
    for req in added:  # ... and must have drafts for its first verify
        assert len(req.drafts) == k, f"{req.req_id} has {len(req.drafts)} drafts after its prefill"
    assert engine.run() == greedy_reference(0, requests)
    for req in added:
        assert req.metrics.verify_steps == rounds
        assert req.metrics.acceptance_length == k + 1
    assert engine.metrics.acceptance_length == k + 1
    assert engine.metrics.steps == 1 + rounds


def test_no_drafts_are_proposed_for_a_request_still_in_prefill() -> None:
    """A request whose prompt is only partly cached has no next token to draft from yet."""
    engine = make_engine(speculator="self", k=3, budget=4)
    req = add(engine, Req("r", tuple(range(1, 13)), 5))  # chunks of 4: 0..4, 4..8, 8..12
    for _ in range(3):
        engine.step()
        if req.in_prefill:
            assert req.drafts == [], f"drafts {req.drafts} proposed with {req.num_computed}/12 prompt tokens cached"


@pytest.mark.parametrize("speculator", ["eagle", "perturbed", "draft-model"])
def test_acceptance_metrics_are_consistent(speculator: str) -> None:
    """Rates per position lie in [0, 1], acceptance never exceeds drafting, tau lies in [1, K+1]."""
    k = 4
    requests = tuple(Req(f"m{i}", PROMPTS[i], 12) for i in range(3))
    engine = make_engine(speculator=speculator, k=k)
    for r in requests:
        add(engine, r)
    assert engine.run() == greedy_reference(0, requests)
    m = engine.metrics
    assert len(m.acceptance_rate_by_position) == k
    assert all(0.0 <= rate <= 1.0 for rate in m.acceptance_rate_by_position)
    assert 0 <= m.accepted <= m.drafted
    assert sum(m.accepted_by_position) == m.accepted and sum(m.drafted_by_position) == m.drafted
    assert all(a <= d for a, d in zip(m.accepted_by_position, m.drafted_by_position, strict=True))
    assert 1.0 <= m.acceptance_length <= k + 1
    assert m.acceptance_length == pytest.approx((m.accepted + m.verify_steps) / m.verify_steps)


@pytest.mark.parametrize("cut", ["max_tokens", "stop_token"])
def test_streamed_tokens_and_tokens_emitted_match_the_output(cut: str) -> None:
    """What step() reports as emitted must be exactly what was appended to the output."""
    k = 4
    greedy = greedy_reference(0, (Req("r", PROMPTS[0], 40),))["r"]
    if cut == "max_tokens":
        req_spec = Req("r", PROMPTS[0], 4)  # a verify of 5 tokens, only part of which fits
    else:
        stop_at = stop_inside_run(PROMPTS[0], k)
        assert stop_at is not None
        req_spec = Req("r", PROMPTS[0], 40, stop_token_ids=(greedy[stop_at],))
    engine = make_engine(speculator="self", k=k)
    output = add(engine, req_spec).output
    streamed: list[int] = []
    for result in run_steps(engine):
        streamed.extend(result.emitted.get("r", []))
    assert engine.metrics.tokens_emitted == len(output)
    assert streamed == output


# -- 5. continuous batching ----------------------------------------------------------------------------


@pytest.mark.parametrize("speculator", ["none", "self", "eagle"])
def test_prompt_longer_than_the_token_budget_is_prefilled_in_chunks(speculator: str) -> None:
    """A 20-token prompt under a budget of 6 takes ceil(20/6) = 4 steps before its first token."""
    budget, prompt, max_tokens = 6, tuple((7 * i + 3) % VOCAB for i in range(20)), 6
    engine = make_engine(speculator=speculator, k=3, budget=budget, block_size=4, num_blocks=64)
    req = add(engine, Req("long", prompt, max_tokens))
    seen: list[tuple[int, int]] = []

    def chunked(e: Engine, result: StepResult) -> None:
        assert_kv_consistent(e, result)
        seen.append((e.metrics.tokens_scheduled, req.num_computed))

    with contracts.enforce("full"):
        results = run_steps(engine, chunked)
    chunks = math.ceil(len(prompt) / budget)
    assert [r.emitted for r in results[: chunks - 1]] == [{}] * (chunks - 1), "no token before the prompt is in"
    assert [computed for _, computed in seen[:chunks]] == [6, 12, 18, 20]
    assert list(results[chunks - 1].emitted) == ["long"]
    scheduled = [b - a for (a, _), (b, _) in zip([(0, 0), *seen], seen, strict=False)]
    assert all(n <= budget for n in scheduled)
    if speculator == "none":
        assert engine.metrics.steps == chunks + max_tokens - 1
    else:
        assert engine.metrics.steps >= chunks + 1
    assert req.output == greedy_reference(0, (Req("long", prompt, max_tokens),))["long"]


def test_chunked_prefill_shares_the_budget_with_decoding_requests() -> None:
    """A long prompt arriving while others decode is chunked into the budget they leave, in the same steps."""
    budget = 12
    short = tuple(Req(f"s{i}", PROMPTS[i], 12) for i in range(3))
    long = Req("long", tuple((5 * i + 1) % VOCAB for i in range(25)), 5)
    engine = make_engine(speculator="perturbed", k=2, budget=budget, num_blocks=64, block_size=2)
    added = {r.req_id: add(engine, r) for r in short}
    engine.step()
    added["long"] = long_req = add(engine, long)
    mixed_steps = 0
    while not long_req.output:
        before, computed = engine.metrics.tokens_scheduled, long_req.num_computed
        result = engine.step()
        assert engine.metrics.tokens_scheduled - before <= budget
        assert_kv_consistent(engine)
        chunk = long_req.num_computed - computed
        if 0 < chunk < budget and any(rid.startswith("s") for rid in result.emitted):
            mixed_steps += 1
    assert mixed_steps >= 1, "no step mixed a prefill chunk with decoding requests"
    engine.run()
    outputs = {rid: r.output for rid, r in added.items()}
    assert outputs == greedy_reference(0, (*short, long))


@pytest.mark.parametrize("speculator", ["none", "eagle"])
def test_max_num_seqs_limits_concurrent_requests(speculator: str) -> None:
    """No more than max_num_seqs requests run at once; the rest wait their turn and still decode correctly."""
    max_seqs = 2
    requests = tuple(Req(f"q{i}", PROMPTS[i], 4 + i) for i in range(6))
    engine = make_engine(speculator=speculator, k=2, max_num_seqs=max_seqs)
    added = {r.req_id: add(engine, r) for r in requests}
    saturated: list[bool] = []

    def bounded(e: Engine, result: StepResult) -> None:
        assert len(e.scheduler.running) <= max_seqs
        assert len(result.emitted) <= max_seqs
        saturated.append(len(e.scheduler.running) == max_seqs and bool(e.scheduler.waiting))

    run_steps(engine, bounded)
    assert any(saturated), "the limit was never reached, so it was never tested"
    assert {rid: r.output for rid, r in added.items()} == greedy_reference(0, requests)
