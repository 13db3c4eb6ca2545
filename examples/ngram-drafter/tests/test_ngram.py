"""The n-gram backend: lossless under the engine's batching, accepted where text repeats, and tidy.

Only public names are used: ``specdec``'s top level, ``contracts``, the
registry and the testing kit, as a third-party backend's tests would.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from hypothesis import given, settings
from specdec_ngram import NgramSpeculator, lookup, make_speculator

import contracts
from specdec import Engine, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig, Transformer
from specdec.backend_registry import available_backends, create
from specdec.cli.main import main
from specdec.testing.dp_run import DPRunSpec, RequestSpec, dp_run_specs, merged, plain_outputs, run_in_process

MODEL = ModelConfig.tiny()


@functools.cache
def target(seed: int = 0) -> Transformer:
    return Transformer(MODEL, seed=seed)


def ngram_k3(t: Transformer) -> NgramSpeculator:
    """Module-level, so a ``DPRunSpec`` holding it stays picklable."""
    return make_speculator(t, num_spec_tokens=3)


# -- the lookup ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([5, 6, 7, 8, 5, 6], [7, 8, 5, 6]),  # suffix 5 6 occurred at 0: what followed, then the copy continues
        ([1, 2, 9, 1, 2, 7, 1, 2], [7, 1, 2, 7]),  # the most recent occurrence wins
        ([3, 4, 3, 9, 9, 3, 4], [3, 9, 9, 3]),  # the longest suffix (3 4) wins over the latest 1-gram (4 at 1 only)
        ([1, 2, 1, 2, 1], [2, 1, 2, 1]),  # a period shorter than K still gives K drafts
        ([4, 4], [4, 4, 4, 4]),
        ([1, 2, 3, 4], []),  # nothing repeats
        ([7], []),
    ],
)
def test_lookup(tokens: list[int], expected: list[int]) -> None:
    assert lookup(tokens, 4) == expected


def test_lookup_respects_the_ngram_bounds() -> None:
    assert lookup([1, 2, 3, 9, 3], 2, min_ngram=2, max_ngram=3) == []  # only a 1-gram (3) repeats
    assert lookup([1, 2, 3, 9, 3], 2, min_ngram=1, max_ngram=3) == [9, 3]


def test_bad_options_are_rejected_with_the_values() -> None:
    with pytest.raises(ValueError, match=r"num_spec_tokens \(K\) must be >= 1, got 0"):
        NgramSpeculator(num_spec_tokens=0)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram, got 3 and 2"):
        NgramSpeculator(min_ngram=3, max_ngram=2)


# -- discovery -------------------------------------------------------------------------------------


def test_the_entry_point_makes_it_a_backend() -> None:
    found = available_backends()
    assert {"ngram", "eagle", "draft-model", "dflash", "dspark"} <= set(found)
    spec = create("ngram", target(), num_spec_tokens=5, max_ngram=4)
    assert isinstance(spec, NgramSpeculator) and spec.num_spec_tokens == 5 and spec.max_ngram == 4


def test_specdec_generate_runs_the_ngram_backend(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--backend", "ngram", "-k", "3", "--num-requests", "2", "--max-tokens", "24"]
    assert (
        main([*args, "--layers", "2", "--hidden", "32", "--compare-plain", "--contracts", "full", "1 2 3 1 2 3"]) == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"^ngram .*tokens\s+48", out, re.M) and re.search(r"^plain .*tokens\s+48", out, re.M)


# -- losslessness ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(dp_run_specs(MODEL))
def test_greedy_output_equals_plain_decoding_on_any_batching(spec: DPRunSpec) -> None:
    """Uneven DP ranks, chunked prefills, graph modes: drafting changes when tokens come out, never which."""
    spec = dataclasses.replace(spec, speculator=ngram_k3)
    assert merged(run_in_process(spec)) == plain_outputs(spec)


def test_sampled_output_is_valid_with_one_hot_proposals() -> None:
    """Temperature > 0: argmax-style drafts go to rejection sampling as one-hot proposals."""
    engine = Engine(target(), EngineConfig(seed=3), speculator=make_speculator(target(), num_spec_tokens=4))
    for i in range(3):
        engine.add_request(f"s{i}", [1, 2, 3, 1, 2, 3, i], params=SamplingParams(temperature=0.8), max_tokens=20)
    with contracts.enforce("full"):
        outputs = engine.run()
    assert all(len(out) == 20 and all(0 <= t < MODEL.vocab_size for t in out) for out in outputs.values())


# -- acceptance ------------------------------------------------------------------------------------


def repetitive_requests(n: int) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(f"rep{i}", (3 + i, 14, 15, 92, 65) * 4, max_tokens=48) for i in range(n))


def test_drafts_are_accepted_on_repetitive_text() -> None:
    """A random tiny target falls into loops under greedy decoding, and its prompt repeats: tau well above 1."""
    spec = DPRunSpec(MODEL, 0, EngineConfig(), (repetitive_requests(4),), ngram_k3)
    (result,) = run_in_process(spec)
    assert result.outputs == plain_outputs(spec)
    m = result.metrics
    assert m.drafted > 0 and m.accepted > 0
    assert m.acceptance_length > 1.3, f"tau {m.acceptance_length:.2f}: drafted {m.drafted}, accepted {m.accepted}"


# -- the history it keeps --------------------------------------------------------------------------


def test_history_follows_chunking_rejection_and_preemption_and_is_freed_on_finish() -> None:
    """After every step the drafter's history of each request is exactly the request's committed tokens."""
    speculator = make_speculator(target(), num_spec_tokens=3)
    config = EngineConfig(
        num_blocks=14,  # four long requests on a cache that holds barely one: preemption must happen
        block_size=2,
        scheduler=SchedulerConfig(max_num_batched_tokens=5, max_num_seqs=4, max_model_len=64),  # chunked prefills
    )
    engine = Engine(target(), config, speculator=speculator)
    requests = repetitive_requests(4)
    added = {r.req_id: engine.add_request(r.req_id, list(r.prompt[:12]), max_tokens=12) for r in requests}
    with contracts.enforce("full"):
        while engine.has_work:
            engine.step()
            for rid in speculator.tracked_requests:
                req = added[rid]
                assert not req.finished, f"{rid} finished but its history was kept"
                assert speculator.history(rid) == tuple(req.tokens[: req.num_computed])
    assert sum(req.metrics.preemptions for req in added.values()) > 0, "the cache was sized to preempt"
    assert speculator.tracked_requests == frozenset()
    assert engine.metrics.accepted > 0
    plain = Engine(target(), EngineConfig())
    for r in requests:
        plain.add_request(r.req_id, list(r.prompt[:12]), max_tokens=12)
    assert {rid: req.output for rid, req in added.items()} == plain.run()


def test_finish_releases_the_history() -> None:
    speculator = make_speculator(target(), num_spec_tokens=2)
    engine = Engine(target(), EngineConfig(), speculator=speculator)
    engine.add_request("a", [1, 2, 1, 2, 1], max_tokens=30)
    engine.add_request("b", [7, 7, 7], max_tokens=2)
    engine.step()
    assert speculator.tracked_requests == {"a", "b"}
    while "b" not in engine.step().finished:
        pass
    assert "b" not in speculator.tracked_requests and speculator.history("b") == ()
    assert "a" in speculator.tracked_requests
    speculator.finish("a")
    speculator.finish("a")  # finishing twice (preempted, then finished) is harmless
    assert speculator.tracked_requests == frozenset()
