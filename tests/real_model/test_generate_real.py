"""``specdec generate --model``: streamed text from a real model, lossless under a drafter, one summary line.

Runs on the cached SmolLM2 (skipped when it is not pulled, a failure under CI)
with prompts the model answers in a handful of tokens and then stops, so the
whole file takes seconds: "Repeat exactly: ..." is 8 tokens ending in
``<|im_end|>``, and an n-gram drafter accepts most of its drafts on it.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from real_models import SMOLLM2, PulledModel, smollm2  # noqa: F401  (fixture)

from specdec.backend_registry import available_backends, create, register, unregister
from specdec.cli.main import main
from specdec.cli.streaming import drafter_weights_are_random, engine_for, stream_request
from specdec.engine import Engine, EngineConfig
from specdec.request import FinishReason
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig

PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat."
MAX_TOKENS = 24


class Recorder:
    """A stdout that keeps every ``write`` separately, to see text arrive piece by piece."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.writes)


@dataclass(frozen=True)
class CliRun:
    writes: list[str]
    body: str
    """The streamed text (stdout up to the newline before the summary)."""
    summary: str


@pytest.fixture(autouse=True, scope="module")
def ngram_backend() -> Iterator[None]:
    """The example n-gram backend under its name, installed (CI) or not (the README's bare `pytest`).

    Without its package installed, its factory is registered in-process from
    the example's source tree, so these tests run on a fresh checkout too.
    """
    if "ngram" in available_backends():
        yield
        return
    source = str(Path(__file__).resolve().parents[2] / "examples" / "ngram-drafter" / "src")
    sys.path.insert(0, source)
    try:
        register("ngram", importlib.import_module("specdec_ngram").make_speculator)
        yield
        unregister("ngram")
    finally:
        sys.path.remove(source)


def run_cli(*args: str) -> CliRun:
    out = Recorder()
    with contextlib.redirect_stdout(out):  # type: ignore[type-var]
        assert main(["generate", "--model", SMOLLM2, "--max-tokens", str(MAX_TOKENS), *args, PROMPT]) == 0
    assert out.text.endswith("\n")
    body, summary = out.text[:-1].rsplit("\n", 1)
    return CliRun(out.writes, body, summary)


@pytest.fixture(scope="module")
def plain_run(smollm2: PulledModel) -> CliRun:  # noqa: F811
    return run_cli("--backend", "plain")


@pytest.fixture(scope="module")
def ngram_run(smollm2: PulledModel) -> CliRun:  # noqa: F811
    return run_cli("--backend", "ngram", "--compare-plain")


@pytest.fixture(scope="module")
def engine_tokens(smollm2: PulledModel) -> list[int]:  # noqa: F811
    """Plain greedy decoding through ``Engine`` directly, stopping at the tokenizer's stop tokens."""
    tok = smollm2.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
    engine = Engine(smollm2.model, EngineConfig(num_blocks=8, block_size=16, scheduler=SchedulerConfig()))
    engine.add_request("r", prompt, max_tokens=MAX_TOKENS, stop_token_ids=tok.stop_token_ids)
    with torch.inference_mode():
        return engine.run()["r"]


def test_plain_greedy_text_is_the_text_of_the_engines_greedy_tokens(
    smollm2: PulledModel,  # noqa: F811
    plain_run: CliRun,
    engine_tokens: list[int],
) -> None:
    assert engine_tokens[-1] in smollm2.tokenizer.stop_token_ids  # the model stops by itself on this prompt
    assert plain_run.body == smollm2.tokenizer.decode(engine_tokens, skip_special_tokens=True)
    assert "the cat sat on the mat" in plain_run.body.lower()


def test_a_drafter_gives_identical_greedy_text(plain_run: CliRun, ngram_run: CliRun) -> None:
    assert ngram_run.body == plain_run.body
    assert "same tokens as plain" in ngram_run.summary


def test_text_is_streamed_in_pieces_before_the_summary(plain_run: CliRun) -> None:
    summary_at = next(i for i, w in enumerate(plain_run.writes) if w.startswith("plain:"))
    pieces = [w for w in plain_run.writes[:summary_at] if w != "\n"]
    assert len(pieces) >= 4 and all(pieces)  # one write per decoded piece, not one at the end
    assert "".join(plain_run.writes[:summary_at]) == plain_run.body + "\n"


def test_summary_line_fields(plain_run: CliRun, ngram_run: CliRun, engine_tokens: list[int]) -> None:
    plain = re.fullmatch(
        r"plain:  tokens (\d+)  steps (\d+)  ([\d.]+) tokens/s  speedup at most ~([\d.]+)x "
        r"\(tokens per target forward; drafting not counted\)  finish stop_token",
        plain_run.summary,
    )
    assert plain is not None, plain_run.summary
    tokens, steps, rate, speedup = int(plain[1]), int(plain[2]), float(plain[3]), float(plain[4])
    assert tokens == steps == len(engine_tokens)  # plain decoding: one token per target forward, prefill included
    assert rate > 0 and speedup == 1.0
    spec = re.fullmatch(
        r"ngram:  tokens (\d+)  steps (\d+)  tau ([\d.]+) \(accepted (\d+)/(\d+) drafts\)  ([\d.]+) tokens/s  "
        r"speedup ([\d.]+)x measured \(same tokens as plain, plain ([\d.]+) tokens/s\)  finish stop_token",
        ngram_run.summary,
    )
    assert spec is not None, ngram_run.summary
    assert int(spec[1]) == len(engine_tokens) and int(spec[2]) < int(spec[1])  # drafts accepted: fewer forwards
    assert float(spec[3]) > 1.5 and 0 < int(spec[4]) <= int(spec[5])
    assert "random" not in ngram_run.summary  # n-gram lookup has no weights to be untrained


def test_stream_request_emits_whole_text_incrementally_greedy_and_sampled(smollm2: PulledModel) -> None:  # noqa: F811
    tok = smollm2.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
    chunks: list[str] = []
    with torch.inference_mode():
        greedy = stream_request(
            engine_for(smollm2.model, len(prompt), 8),
            tok,
            prompt,
            params=SamplingParams(temperature=0.0),
            max_tokens=8,
            on_text=chunks.append,
        )
        sampled = [
            stream_request(
                engine_for(smollm2.model, len(prompt), 6, seed=7),
                tok,
                prompt,
                params=SamplingParams(temperature=0.8),
                max_tokens=6,
                on_text=lambda _: None,
                seed=7,
            )
            for _ in range(2)
        ]
    assert greedy.chunks == len(chunks) >= 4 and all(chunks)
    assert "".join(chunks) == greedy.text == tok.decode(greedy.tokens, skip_special_tokens=True)
    assert greedy.finish_reason in (FinishReason.STOP_TOKEN, FinishReason.MAX_TOKENS)
    assert sampled[0].tokens == sampled[1].tokens and 1 <= len(sampled[0].tokens) <= 6  # seeded: reproducible


def test_untrained_drafters_are_reported_as_random(smollm2: PulledModel) -> None:  # noqa: F811
    target = smollm2.model
    assert drafter_weights_are_random(create("eagle", target, num_spec_tokens=2), target)
    assert not drafter_weights_are_random(create("draft-model", target, num_spec_tokens=2, draft=target), target)
    assert not drafter_weights_are_random(create("ngram", target, num_spec_tokens=2), target)
    assert not drafter_weights_are_random(None, target)


def test_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2  # a user mistake: one line, exit 2
    assert capsys.readouterr().err == (
        "specdec: error: unknown model 'no-such-model'; known models: smollm2-135m-instruct\n"
    )
