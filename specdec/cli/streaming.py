"""Streaming one request through the engine as text, and the one-line summary ``specdec generate`` ends with.

The engine reports the tokens each step accepted (``StepResult.emitted``); a
speculative step can accept several at once, so text arrives in bursts of up
to K + 1 tokens. The tokenizer's ``StreamDecoder`` turns them into whole
characters, so a multi-byte character split across tokens (or across steps)
is never shown half-done. Special tokens (the stop token, chat markers) are
not shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from specdec.draft_decisions import describe_decisions
from specdec.engine import Engine, EngineConfig, RunMetrics
from specdec.hub.tokenizer import Tokenizer
from specdec.nn.transformer import Transformer
from specdec.request import FinishReason
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator


@dataclass(frozen=True)
class StreamResult:
    """What one streamed request produced, and what it cost."""

    tokens: list[int]
    text: str
    chunks: int
    """How many non-empty pieces of text were written (at most one per engine step)."""
    finish_reason: FinishReason | None
    wall_s: float
    first_token_s: float
    metrics: RunMetrics
    stop_string: str | None = None
    """The ``--stop`` text that ended it, if one did (the engine then reports it aborted)."""

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per target forward (engine step): 1 for plain decoding, tau-like for speculation."""
        return self.metrics.tokens_per_step


def engine_for(
    target: Transformer, prompt_len: int, max_tokens: int, *, speculator: Speculator | None = None, seed: int = 0
) -> Engine:
    """An engine sized for one request: enough KV blocks for prompt, output and draft headroom, no more."""
    block_size = 16
    headroom = (speculator.num_spec_tokens if speculator is not None else 0) + 1
    max_model_len = target.config.max_model_len
    if prompt_len >= max_model_len:
        raise ValueError(f"the prompt has {prompt_len} tokens; the model's context is {max_model_len}")
    longest = min(prompt_len + max_tokens + headroom, max_model_len)
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=1, max_model_len=max_model_len)
    config = EngineConfig(
        num_blocks=-(-longest // block_size) + 1, block_size=block_size, seed=seed, scheduler=scheduler
    )
    return Engine(target, config, speculator=speculator)


def stream_request(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    *,
    params: SamplingParams,
    max_tokens: int,
    on_text: Callable[[str], None],
    seed: int | None = None,
    req_id: str = "0",
) -> StreamResult:
    """Run ``prompt`` to completion on ``engine`` (which must hold no other request), writing text as it arrives.

    Stops at the tokenizer's stop tokens, at ``max_tokens`` or at the model's
    length. ``on_text`` gets each non-empty piece of new text.
    """
    if engine.requests:
        raise ValueError(f"stream_request needs an idle engine; it already holds {sorted(engine.requests)}")
    request = engine.add_request(
        req_id, prompt, params=params, max_tokens=max_tokens, stop_token_ids=tokenizer.stop_token_ids, seed=seed
    )
    decoder = tokenizer.stream(skip_special_tokens=True)
    pieces: list[str] = []

    def write(text: str) -> None:
        if text:
            pieces.append(text)
            on_text(text)

    start = time.perf_counter()
    first_token = 0.0
    while engine.has_work:
        emitted = engine.step().emitted.get(req_id)
        if emitted:
            if not first_token:
                first_token = time.perf_counter() - start
            write(decoder.push(emitted))
    write(decoder.flush())
    wall = time.perf_counter() - start
    return StreamResult(
        tokens=list(request.output),
        text="".join(pieces),
        chunks=len(pieces),
        finish_reason=request.finish_reason,
        wall_s=wall,
        first_token_s=first_token,
        metrics=engine.metrics,
    )


def drafter_weights_are_random(speculator: Speculator | None, target: Transformer) -> bool:
    """Whether the drafter runs on its own freshly seeded weights rather than trained ones.

    The built-in backends say so with a ``weights_source`` attribute (``"random"``,
    ``"shipped:<model>/<backend>"`` or ``"trained:<path>"`` for trained weights, ``docs/drafters.md``).
    A backend that does not say counts as random when it owns parameters beyond
    the target's: nothing tells trained ones apart. A drafter without a network
    (n-gram lookup) or one drafting with the target itself is not. Only the
    speculator's own attributes are inspected.
    """
    if speculator is None:
        return False
    declared = getattr(speculator, "weights_source", None)
    if isinstance(declared, str):
        return declared == "random"
    shared = {id(p) for p in target.parameters()}
    networks = (
        [v for v in vars(speculator).values() if isinstance(v, nn.Module)] if hasattr(speculator, "__dict__") else []
    )
    return any(id(p) not in shared for network in networks for p in network.parameters())


def summary_line(
    backend: str,
    result: StreamResult,
    *,
    random_drafter: bool = False,
    plain: StreamResult | None = None,
    adaptive: bool = False,
) -> str:
    """The one line ``specdec generate --model`` ends with: tokens, steps, tau, tokens/s and a speedup estimate.

    ``adaptive``: the run chose its draft lengths, and the line counts its decisions by kind.
    """
    m = result.metrics
    speculative = backend != "plain"
    fields = [f"{backend}:", f"tokens {len(result.tokens)}", f"steps {m.steps}"]
    if speculative:
        tau = f"{m.acceptance_length:.2f}" if m.verify_steps else "-"
        fields.append(f"tau {tau} (accepted {m.accepted}/{m.drafted} drafts)")
    fields.append(f"{result.tokens_per_s:.1f} tokens/s")
    if plain is not None and speculative:
        ratio = result.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else float("nan")
        same = "same tokens as plain, " if result.tokens == plain.tokens else ""
        fields.append(f"speedup {ratio:.2f}x measured ({same}plain {plain.tokens_per_s:.1f} tokens/s)")
    else:
        fields.append(
            f"speedup at most ~{result.tokens_per_forward:.2f}x (tokens per target forward; drafting not counted)"
        )
    finish = result.finish_reason.value if result.finish_reason is not None else "unfinished"
    if result.stop_string is not None:
        finish = f"stop_string {result.stop_string!r}"
    fields.append(f"finish {finish}")
    if adaptive:
        fields.append(f"decisions: {describe_decisions(m.decisions)}")
    line = "  ".join(fields)
    if random_drafter:
        line += "  [drafter weights are random (untrained): tau ~1 expected; output is still exactly the target's]"
    return line
