"""``specdec.LLM``: generate text in one call, in the terms vLLM users already know.

    llm = LLM("smollm2-135m-instruct", speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64, temperature=0.0, stop=["\\n\\n"]))
    print(out[0].outputs[0].text, out[0].metrics.acceptance_length)

Behind it is the same engine the CLI and the tests drive, with every step
checked in the process's contract mode. Each ``generate`` call builds an
engine whose KV pool holds all its requests at once (no preemption) and a
fresh drafter, so calls do not share drafter state; under
``draft_length="adaptive"`` they share one draft-length policy, which keeps
what earlier calls measured (step costs, acceptance rates), as a server would.
Stop strings are found in the
detokenized text after each step; a request that produced one is aborted,
which frees its KV blocks and drafter state at once.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.backend_registry import available_backends, factory_for, names_option
from specdec.draft_length import DraftLengthPolicy
from specdec.engine import DRAFT_LENGTHS, Engine, EngineConfig
from specdec.hub.loader import load
from specdec.hub.local import is_path
from specdec.hub.tokenizer import Message, Tokenizer
from specdec.metrics import RequestMetrics, RunMetrics
from specdec.nn.transformer import Transformer
from specdec.request import FinishReason, Request
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

SPECULATIVE_KEYS = ("method", "num_speculative_tokens")
"""The keys every ``speculative_config`` takes; the rest are the method's own options (its factory's parameters)."""
BLOCK_SIZE = 16


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    """``"stop"`` (a stop token or stop string), ``"length"`` (``max_tokens`` or the model's context)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, if one did."""


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and what was generated for it, with the request's speculation metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics = field(repr=False)
    """Drafted and accepted counts, ``acceptance_length`` (tau) and ``acceptance_rate_by_position``."""

    @property
    def finished(self) -> bool:
        return True


@dataclass(frozen=True)
class StreamedOutput:
    """What ``LLM.stream`` produced for its one prompt, and what it cost."""

    output: RequestOutput
    chunks: int
    """How many pieces of text were written (at most one per engine step)."""
    wall_s: float
    first_token_s: float
    run_metrics: RunMetrics
    """The engine's totals: steps and tokens per step (target forwards), beside the request's own counts."""
    finish: FinishReason | None
    """How the engine ended the request (``ABORTED`` when a stop string ended it)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated ``speculative_config``: the backend, K, and the backend's own options."""

    backend: str
    num_speculative_tokens: int
    options: dict[str, Any]

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> SpeculativeConfig:
        """Check the method and every key against the backend's factory; an unknown key lists the valid ones."""
        if not isinstance(config, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        method = config.get("method")
        if not isinstance(method, str):
            raise ValueError(f"speculative_config needs a 'method' (one of {', '.join(_methods())}), got {method!r}")
        backend = method if method in available_backends() or ":" in method else method.replace("_", "-")
        try:
            factory = factory_for(backend)
        except (ValueError, ImportError, TypeError) as exc:
            raise ValueError(f"speculative_config method {method!r}: {exc}") from None
        k = config.get("num_speculative_tokens", 4)
        if type(k) is not int or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        own = _options_of(factory)
        options = {key: value for key, value in config.items() if key not in SPECULATIVE_KEYS}
        unknown = sorted(set(options) - set(own))
        if unknown:
            valid = ", ".join([*SPECULATIVE_KEYS, *own])
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} for {method!r}; valid: {valid}")
        return cls(backend, k, options)


def _methods() -> list[str]:
    return [name.replace("-", "_") for name in available_backends()]


def factory_options(factory: Any) -> list[str]:
    """The options a backend factory takes by name, beyond the target and K (what ``speculative_config`` may hold)."""
    return _options_of(factory)


def _options_of(factory: Any) -> list[str]:
    """A factory's keyword options, other than the ones ``LLM`` itself fills in."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in list(params)[1:] if p.kind in kinds and p.name != "num_spec_tokens"]


class LLM:
    """A model (catalog name, GGUF file or checkpoint directory) with an optional drafter.

    ``dtype`` is ``"float32"`` (the default, exact) or ``"bfloat16"``. A
    built-in drafter of a catalog model loads its shipped trained weights
    unless ``speculative_config`` says ``"pretrained": None``.
    ``draft_length``: ``"fixed"`` (the default) drafts K tokens every step and
    samples reproducibly from the seed; ``"adaptive"`` drafts only what the
    measured step cost and acceptance say pays, down to none (greedy output is
    the same; sampled output is exact in distribution but depends on timings).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        speculative_config: Mapping[str, Any] | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        draft_length: str = "fixed",
    ) -> None:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self._configure(speculative_config, max_num_seqs, draft_length)
        target, tokenizer = load(model, dtype=getattr(torch, dtype))
        self._attach(target, tokenizer, None if is_path(model) else str(model), seed, max_num_seqs, max_model_len)

    @classmethod
    def from_model(
        cls,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        speculative_config: Mapping[str, Any] | None = None,
        catalog_model: str | None = None,
        seed: int = 0,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        draft_length: str = "fixed",
    ) -> LLM:
        """An ``LLM`` over a model already loaded: the CLI loads with progress, and a plain baseline shares weights.

        ``catalog_model`` names the catalog model it is, whose shipped drafter weights a built-in drafter loads.
        """
        llm = cls.__new__(cls)
        llm._configure(speculative_config, max_num_seqs, draft_length)
        llm._attach(model, tokenizer, catalog_model, seed, max_num_seqs, max_model_len)
        return llm

    def _configure(self, speculative_config: Mapping[str, Any] | None, max_num_seqs: int, draft_length: str) -> None:
        """Check the options that need no model, before one is loaded."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length must be one of {', '.join(map(repr, DRAFT_LENGTHS))}, got {draft_length!r}")
        self.speculative = None if speculative_config is None else SpeculativeConfig.parse(speculative_config)
        if draft_length == "adaptive" and self.speculative is None:
            raise ValueError("draft_length='adaptive' chooses how many tokens to draft: it needs a speculative_config")
        self.draft_length = draft_length
        self.draft_policy: DraftLengthPolicy | None = (
            DraftLengthPolicy(self.speculative.num_speculative_tokens)
            if self.speculative is not None and draft_length == "adaptive"
            else None
        )
        """The adaptive draft length's one policy, taught by every call's engine in turn (``None`` at fixed)."""

    def _attach(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        catalog_model: str | None,
        seed: int,
        max_num_seqs: int,
        max_model_len: int | None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        limit = self.model.config.max_model_len
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] (the model's context), got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self.seed = seed
        self.max_num_seqs = max_num_seqs
        self._catalog_model = catalog_model
        self._next_id = 0
        self.last_speculator: Speculator | None = None
        """The drafter of the latest call (a fresh one per call), for callers that report on its weights."""
        self.drafter_notice: str | None = None
        """Why a built-in drafter runs on fresh weights although shipped ones were looked for, if it does."""

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # -- generation ------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids), in order; one ``SamplingParams`` for all or one each."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        if not items:
            return []
        texts = [p if isinstance(p, str) else None for p in items]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in items]  # type: ignore[call-overload]
        return self._run(texts, ids, self._params_for(sampling_params, len(items)))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, each in the model's own chat template."""
        if not messages:
            return []
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        texts: list[str | None] = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        ids = [self.tokenizer.encode_chat(c) for c in conversations]  # type: ignore[arg-type]
        return self._run(texts, ids, self._params_for(sampling_params, len(conversations)))

    def _params_for(self, params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
        return list(params)

    def stream(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> StreamedOutput:
        """Complete one prompt, handing ``on_text`` each new piece of text as the engine accepts tokens.

        A speculative step accepts up to K + 1 tokens, so text arrives in
        bursts; a character split across tokens is never shown half-done. With
        stop strings, the last ``len(longest stop) - 1`` characters are held
        back until they cannot begin one, so no part of a stop string is shown.
        """
        params = sampling_params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompts([ids])
        engine = self._engine([ids], [params])
        rid = f"{self._next_id}"
        self._next_id += 1
        request = self._add(engine, rid, ids, params)
        decoder = self.tokenizer.stream(skip_special_tokens=True)
        hold = max((len(s) for s in params.stop), default=1) - 1
        seen, shown, chunks = "", 0, 0

        def show(upto: int) -> None:
            nonlocal shown, chunks
            if upto > shown:
                if on_text is not None:
                    on_text(seen[shown:upto])
                shown, chunks = upto, chunks + 1

        stopped: tuple[int, str] | None = None
        start, first_token = time.perf_counter(), 0.0
        with torch.inference_mode():
            while engine.has_work:
                emitted = engine.step().emitted.get(rid)
                if not emitted:
                    continue
                first_token = first_token or time.perf_counter() - start
                seen += decoder.push(emitted)
                stopped = first_stop(seen, params.stop)
                if stopped is not None:
                    if rid in engine.requests:
                        engine.abort(rid)
                    break
                show(len(seen) - hold)
        if stopped is None:
            seen += decoder.flush()
            stopped = first_stop(seen, params.stop)
        show(len(seen) if stopped is None else stopped[0])
        wall = time.perf_counter() - start
        hit = None if stopped is None else (seen[: stopped[0]], stopped[1])
        output = self._output(rid, prompt if isinstance(prompt, str) else None, request, hit)
        return StreamedOutput(output, chunks, wall, first_token, engine.metrics, request.finish_reason)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; at least one token is needed")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; the context is {self.max_model_len}")

    def _add(self, engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> Request:
        stops = () if params.ignore_eos else self.tokenizer.stop_token_ids
        seed = params.seed if params.seed is not None else (self.seed + int(rid) if params.temperature > 0 else None)
        return engine.add_request(rid, prompt, params=params, stop_token_ids=stops, seed=seed)

    def _run(
        self, texts: list[str | None], prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        self._check_prompts(prompts)
        engine = self._engine(prompts, params)
        ids = [f"{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        requests = {}
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            requests[rid] = self._add(engine, rid, prompt, p)
        stopped: dict[str, tuple[str, str]] = {}
        with torch.inference_mode():
            while engine.has_work:
                result = engine.step()
                for rid in result.emitted:
                    hit = self._stop_string(requests[rid], params[ids.index(rid)])
                    if hit is not None and rid not in stopped and rid in engine.requests:
                        stopped[rid] = hit
                        engine.abort(rid)
                for rid in result.finished:
                    hit = self._stop_string(requests[rid], params[ids.index(rid)])
                    if hit is not None:
                        stopped.setdefault(rid, hit)
        return [self._output(rid, text, requests[rid], stopped.get(rid)) for rid, text in zip(ids, texts, strict=True)]

    def _engine(self, prompts: list[list[int]], params: list[SamplingParams]) -> Engine:
        speculator = self._speculator()
        headroom = (speculator.num_spec_tokens if speculator is not None else 0) + 1
        need = [min(len(p) + q.max_tokens + headroom, self.max_model_len) for p, q in zip(prompts, params, strict=True)]
        blocks = sum(sorted((-(-n // BLOCK_SIZE) + 1 for n in need), reverse=True)[: self.max_num_seqs])
        scheduler = SchedulerConfig(
            max_num_batched_tokens=max(2048, self.max_model_len),
            max_num_seqs=min(self.max_num_seqs, len(prompts)),
            max_model_len=self.max_model_len,
        )
        config = EngineConfig(
            num_blocks=blocks + 1,
            block_size=BLOCK_SIZE,
            seed=self.seed,
            scheduler=scheduler,
            draft_length="adaptive" if self.draft_policy is not None else "fixed",
        )
        self.last_speculator = speculator
        return Engine(self.model, config, speculator=speculator, draft_policy=self.draft_policy)

    def _speculator(self) -> Speculator | None:
        spec = self.speculative
        if spec is None:
            return None
        options = {"num_spec_tokens": spec.num_speculative_tokens, **spec.options}
        factory = factory_for(spec.backend)
        if "pretrained" not in options and self._catalog_model is not None and names_option(factory, "pretrained"):
            try:  # the drafter's shipped weights for this model, where there are any
                return factory(self.model, **options, pretrained=self._catalog_model)
            except FileNotFoundError as exc:  # none shipped for this model: a freshly seeded drafter, still lossless
                self.drafter_notice = f"{exc}; drafting with random weights"
        return factory(self.model, **options)

    def _stop_string(self, request: Request, params: SamplingParams) -> tuple[str, str] | None:
        """The first stop string in the request's text so far: (text before it, the stop string)."""
        if not params.stop:
            return None
        text = self.tokenizer.decode(request.output, skip_special_tokens=True)
        found = first_stop(text, params.stop)
        if found is None:
            return None
        at, stop = found
        return text[:at], stop

    def _output(self, rid: str, text: str | None, request: Request, stopped: tuple[str, str] | None) -> RequestOutput:
        tokens = list(request.output)
        why: int | str | None
        if stopped is not None:
            body, why = stopped
            reason = "stop"
        else:
            body = self.tokenizer.decode(tokens, skip_special_tokens=True)
            ended = tokens[-1] if tokens and tokens[-1] in request.stop_token_ids else None
            reason, why = ("stop", ended) if ended is not None else ("length", None)
        completion = CompletionOutput(0, body, tokens, reason, why)
        return RequestOutput(rid, text, list(request.prompt), [completion], request.metrics)


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` begins, and which it is (None when none occurs)."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found) if found else None
