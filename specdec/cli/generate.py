"""``specdec generate``: run the engine and print what it generated, with speculation metrics.

Two modes. With ``--model NAME`` a real model from the store (pulled on first
use) answers text prompts through ``specdec.LLM``: the chat template is applied
by default, text is streamed as the engine accepts tokens (``LLM.stream``),
generation stops at the model's stop tokens or a ``--stop`` string, and one
summary line ends each answer (``--json``: one JSON object per prompt instead).

Without it, a random tiny target takes token ids and prints token ids for
several requests: the contract exercise, every step checked in the chosen mode,
speculation metrics beside plain decoding. It drives ``Engine`` directly, not
``LLM``: it has no tokenizer (no text, so no stop strings or chat template),
and it reports the engine's totals over requests decoded together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from specdec.backend_registry import create, names_option
from specdec.cli import backend_options
from specdec.cli.argtypes import float_in, list_of, positive_int, seed
from specdec.cli.errors import UsageError, check_backend, check_text
from specdec.cli.prompts_file import FilePrompt, read_prompts
from specdec.draft_decisions import describe_decisions
from specdec.engine import DRAFT_LENGTHS, Engine, EngineConfig, RunMetrics
from specdec.metrics import SpeculationCounters
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.request import FinishReason, Request
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

if TYPE_CHECKING:
    from specdec.llm import StreamedOutput

TINY_PROMPT = "1 2 3 4 5 6 7 8"
REAL_PROMPT = "Write a Python function that reverses a string."


TINY_ONLY = {"num_requests": "--num-requests", "layers": "--layers", "hidden": "--hidden"}
"""Options of the random tiny target: given with ``--model`` they are mistakes, not silently ignored."""
MODEL_ONLY = {
    "chat": "--chat/--no-chat",
    "pretrained": "--pretrained/--no-pretrained",
    "dtype": "--dtype",
    "stop": "--stop",
}
FLAG_OPTIONS = {"fused": "--fused", "draft": "--draft-is-target", "pretrained": "--pretrained/--no-pretrained"}
"""Backend options the flags set: also giving them with -O is a mistake."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help=f"with --model: the prompt text (default: {REAL_PROMPT!r}); without: token ids, space separated "
        f"(default: {TINY_PROMPT!r})",
    )
    p.add_argument(
        "--prompts-file",
        metavar="PATH",
        help="prompts one per line instead of the prompt argument ('-': stdin); JSON lines when PATH ends in .jsonl "
        'or starts with {: {"prompt": ...} or {"messages": [...]} per line (without --model: token ids per line)',
    )
    p.add_argument(
        "--model",
        help="a model from `specdec models list` (pulled on first use), a Llama GGUF file, or a checkpoint directory "
        "(config.json, tokenizer.json, safetensors); without it, a random tiny target runs",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --model: wrap the prompt in the model's chat template as a user message (default: on)",
    )
    p.add_argument(
        "--backend",
        "-b",
        "--backends",
        dest="backend",
        action="extend",
        type=list_of(),
        metavar="NAME",
        help="'plain', an installed backend (entry point group specdec.backends: eagle, draft-model, dflash, "
        "dspark, ...) or a 'module:factory' spec; generate runs one (default: eagle)",
    )
    backend_options.add_backend_option(
        p,
        "an option of the backend's factory, e.g. -O capacity=8 for dspark (repeatable; VALUE is read as a "
        "bool, integer, number or text); an option the backend does not take is refused, listing the valid ones",
    )
    p.add_argument(
        "--pretrained",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --model: load the backend's trained drafter weights for that model where it ships them "
        "(default: on; a backend without them drafts with random weights)",
    )
    p.add_argument(
        "--num-spec-tokens", "-k", type=positive_int, default=None, help="draft tokens per step, K (default: 4)"
    )
    p.add_argument(
        "--fused", action="store_true", help="fused multi-step decode, metadata built once (backends with 'fused')"
    )
    p.add_argument("--draft-is-target", action="store_true", help="draft-model backend drafting with the target itself")
    p.add_argument(
        "--draft-length",
        choices=DRAFT_LENGTHS,
        default=None,
        help="'fixed': K drafts every step, seeded sampling reproducible; 'adaptive': each step drafts only what the "
        "measured step cost and acceptance say pays, down to none, and the summary counts its decisions "
        "(default: fixed)",
    )
    p.add_argument(
        "--num-requests", type=positive_int, default=None, help="requests of the random tiny target (default: 4)"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None, help="tokens to generate at most (default: 32; --model: 256)"
    )
    p.add_argument(
        "--temperature", type=float_in(0.0), default=0.0, help="sampling temperature; 0 is greedy (default: 0)"
    )
    p.add_argument(
        "--top-k", type=positive_int, default=None, help="sample from the k most likely tokens (default: all)"
    )
    p.add_argument(
        "--top-p",
        type=float_in(0.0, 1.0, low_open=True),
        default=None,
        help="sample from the smallest set of tokens whose probability reaches p (default: 1, all)",
    )
    p.add_argument("--seed", type=seed, default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="with --model: text that ends the answer, which stops before it (repeatable; never split at commas)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt (text, token_ids, finish_reason, metrics with tau and acceptance "
        "by position) and nothing else on stdout",
    )
    p.add_argument(
        "--contracts",
        choices=["off", "shapes", "full"],
        default=None,
        help="contract mode (default: $SPECDEC_CONTRACTS when set, else shapes)",
    )
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the ratio")
    p.add_argument("--layers", type=positive_int, default=None, help="layers of the random tiny target (default: 4)")
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=None,
        help="hidden size of the random tiny target, a multiple of 4 (default: 64)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="with --model: the target's dtype (default: float32, exact and fast on any CPU; bfloat16 pays only on "
        "CPUs with AMX or AVX512-BF16)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads (default: 1 for the tiny target, which runs best on one; torch's default with "
        "--model)",
    )


def validate(args: argparse.Namespace) -> None:
    """Refuse flags that do not apply or do not combine, then fill in the defaults that depend on the mode."""
    given = {name: flag for name, flag in {**TINY_ONLY, **MODEL_ONLY}.items() if getattr(args, name) is not None}
    wrong = [flag for name, flag in given.items() if name in (MODEL_ONLY if args.model is None else TINY_ONLY)]
    if wrong:
        one = len(wrong) == 1
        side = (
            f"{'needs' if one else 'need'} --model"
            if args.model is None
            else f"{'applies' if one else 'apply'} to the random tiny target only, not with --model"
        )
        raise UsageError(f"{', '.join(wrong)} {side}")
    args.backend = _one_backend(args.backend)
    if args.prompt is not None and args.prompts_file is not None:
        raise UsageError("give the prompt argument or --prompts-file, not both")
    options = backend_options.collect(args.backend_option)
    if args.backend == "plain":
        if options:
            raise UsageError(f"-O {', '.join(options)} needs a speculative backend; --backend plain drafts nothing")
        speculative = (
            ("-k", args.num_spec_tokens),
            ("--fused", args.fused or None),
            ("--draft-length", args.draft_length),
        )
        extra = [f for f, value in speculative if value is not None]
        extra += ["--draft-is-target"] if args.draft_is_target else []
        if extra:
            verb = "needs" if len(extra) == 1 else "need"
            raise UsageError(f"{', '.join(extra)} {verb} a speculative backend; --backend plain drafts nothing")
    else:
        check_backend(args.backend)
        if args.draft_is_target and not names_option(args.backend, "draft"):
            raise UsageError(
                f"--draft-is-target needs a backend that takes a draft model (draft-model), not {args.backend!r}"
            )
        if args.fused and not names_option(args.backend, "fused"):
            raise UsageError(f"--fused needs a backend with a fused decode (eagle, draft-model), not {args.backend!r}")
        flags = {"fused": args.fused, "draft": args.draft_is_target, "pretrained": args.pretrained is not None}
        twice = [f"-O {key} and {FLAG_OPTIONS[key]}" for key in options if flags.get(key)]
        if twice:
            raise UsageError(f"{', '.join(twice)} set the same backend option; give one")
    args.backend_options = (
        backend_options.checked(args.backend, args.num_spec_tokens or 4, options) if args.backend != "plain" else {}
    )
    if args.temperature == 0.0 and (args.top_k is not None or args.top_p is not None):
        raise UsageError("--top-k and --top-p shape sampling; with --temperature 0 (greedy) they would be ignored")
    args.num_spec_tokens = 4 if args.num_spec_tokens is None else args.num_spec_tokens
    args.draft_length = args.draft_length or "fixed"
    args.params = sampling_params(args)
    if args.model is None:
        if args.prompts_file is not None and args.num_requests is not None:
            raise UsageError("--num-requests copies the one prompt; with --prompts-file each line is a request")
        args.layers = 4 if args.layers is None else args.layers
        args.hidden = 64 if args.hidden is None else args.hidden
        if args.hidden % 4:
            raise UsageError(f"--hidden {args.hidden}: the tiny target has 4 heads, so a multiple of 4 is expected")
        if args.prompts_file is None:
            args.num_requests = 4 if args.num_requests is None else args.num_requests
            first = tiny_prompt(args.prompt)
            args.tiny_prompts = [[t + i for t in first] for i in range(args.num_requests)]  # wrapped at the vocab
        else:
            args.tiny_prompts = [tiny_file_prompt(p) for p in read_prompts(args.prompts_file)]
    else:
        from specdec.hub.local import is_path

        if is_path(args.model) and not Path(args.model).expanduser().exists():
            raise UsageError(f"--model {args.model}: no such file or directory")
        args.chat = True if args.chat is None else args.chat
        args.pretrained = True if args.pretrained is None else args.pretrained
        args.dtype = args.dtype or "float32"
        if args.prompts_file is not None:
            args.prompts = read_prompts(args.prompts_file)
        else:
            text = check_text(REAL_PROMPT if args.prompt is None else args.prompt, "the prompt")
            if not text:
                raise UsageError(
                    "the prompt is empty; give the text to answer (or leave it out for the default prompt)"
                )
            args.prompts = [FilePrompt(0, text=text)]


def _one_backend(given: list[str] | None) -> str:
    if not given:
        return "eagle"
    if len(given) > 1:
        raise UsageError(
            f"generate runs one backend, got {', '.join(given)}; use --compare-plain for plain decoding beside it, "
            "or `specdec bench` to compare several"
        )
    return given[0]


def tiny_prompt(text: str | None) -> list[int]:
    """The random tiny target's prompt: token ids, space separated."""
    words = (TINY_PROMPT if text is None else text).split()
    if not words:
        raise UsageError(f"the prompt is empty; without --model it is token ids, e.g. {TINY_PROMPT!r}")
    bad = [w for w in words if not w.isdigit()]
    if bad:
        raise UsageError(
            f"without --model the prompt is token ids, space separated (e.g. {TINY_PROMPT!r}), not {bad[0]!r}; "
            "pass --model NAME to prompt a real model with text"
        )
    return [int(w) for w in words]


def tiny_file_prompt(prompt: FilePrompt) -> list[int]:
    """A line of ``--prompts-file`` for the random tiny target: token ids (as text or ``{"prompt": ...}``)."""
    if prompt.text is None:
        raise UsageError(f"--prompts-file line {prompt.line}: the random tiny target takes token ids, not messages")
    try:
        return tiny_prompt(prompt.text)
    except UsageError as exc:
        raise UsageError(f"--prompts-file line {prompt.line}: {exc}") from None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    max_tokens = args.max_tokens or (32 if args.model is None else 256)
    try:
        return SamplingParams(
            temperature=float(args.temperature),
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=max_tokens,
            stop=args.stop or (),
        )
    except ValidationError as exc:  # e.g. a temperature below the smallest float32 normal
        raise UsageError("; ".join(f"--{'-'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def speculative_config(args: argparse.Namespace, target: Transformer) -> dict[str, Any] | None:
    """The flags and ``-O`` options as a ``speculative_config`` (None: plain decoding).

    Options a backend may not know are passed only when asked for, so a strict factory fails loudly then.
    """
    if args.backend == "plain":
        return None
    config: dict[str, Any] = {"method": args.backend, "num_speculative_tokens": args.num_spec_tokens}
    if args.fused:
        config["fused"] = True
    if args.draft_is_target:
        config["draft"] = target
    if args.model is not None and not args.pretrained and names_option(args.backend, "pretrained"):
        config["pretrained"] = None  # fresh weights rather than the shipped ones
    return {**config, **args.backend_options}


def _speculator(args: argparse.Namespace, target: Transformer) -> Speculator | None:
    config = speculative_config(args, target)
    if config is None:
        return None
    options = {k: v for k, v in config.items() if k not in ("method", "num_speculative_tokens")}
    with _option_errors(args):
        return create(args.backend, target, num_spec_tokens=args.num_spec_tokens, **options)


class _option_errors:
    """A factory refusing a ``-O`` value (a wrong type, out of range) is the user's mistake, not a bug."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.options = args.backend_options

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.options and isinstance(exc, (TypeError, ValueError)):
            raise backend_options.refused(self.options, exc) from None


def _build(args: argparse.Namespace, target: Transformer, backend: str) -> tuple[Engine, list[Request]]:
    speculator = _speculator(args, target) if backend != "plain" else None
    config = EngineConfig(
        num_blocks=1024,
        block_size=16,
        seed=args.seed,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024),
        draft_length=args.draft_length if speculator is not None else "fixed",
    )
    engine = Engine(target, config, speculator=speculator)
    vocab = target.config.vocab_size
    requests = [
        engine.add_request(f"req-{i}", [t % vocab for t in prompt], params=args.params)
        for i, prompt in enumerate(args.tiny_prompts)
    ]
    return engine, requests


def _summary(name: str, m: RunMetrics, tokens: int, wall: float, *, adaptive: bool) -> str:
    by_pos = ", ".join(f"{r:.2f}" for r in m.acceptance_rate_by_position) or "-"
    tau = f"{m.acceptance_length:.2f}" if m.verify_steps else "-"
    line = (
        f"{name:<12} tokens {tokens:5d}  steps {m.steps:4d}  tokens/step {m.tokens_per_step:5.2f}  "
        f"drafted {m.drafted:5d}  accepted {m.accepted:5d}  tau {tau:>5}  "
        f"accept by position [{by_pos}]  {tokens / wall:8.1f} tok/s  ({wall:.2f} s)"
    )
    return line + (f"  decisions: {describe_decisions(m.decisions)}" if adaptive else "")


def speculation_json(m: SpeculationCounters) -> dict[str, Any]:
    """The speculation counts every ``--json`` object carries: tau (None before a verify step) and by position."""
    return {
        "drafted": m.drafted,
        "accepted": m.accepted,
        "verify_steps": m.verify_steps,
        "tau": round(m.acceptance_length, 4) if m.verify_steps else None,
        "acceptance_by_position": [round(r, 4) for r in m.acceptance_rate_by_position],
    }


FINISH = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.MAX_TOKENS: "length",
    FinishReason.MAX_MODEL_LEN: "length",
    FinishReason.ABORTED: "stop",
}
"""The engine's reasons in ``specdec.LLM``'s terms (``ABORTED``: the CLI aborts only at a stop string)."""


def emit_json(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def contract_mode(flag: str | None) -> str:
    """The flag when given, else ``SPECDEC_CONTRACTS`` (already validated by ``contracts`` at import), else shapes."""
    from contracts.enforcement import ENV_VAR

    return flag or os.environ.get(ENV_VAR, "").strip().lower() or "shapes"


def run(args: argparse.Namespace) -> int:
    import torch

    import contracts

    args.contracts = contract_mode(args.contracts)
    validate(args)
    if args.model is not None:
        return run_model(args)
    torch.set_num_threads(1 if args.threads is None else args.threads)
    contracts.set_mode(args.contracts)
    config = ModelConfig.tiny(
        num_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden, head_dim=args.hidden // 4
    )
    target = Transformer(config, seed=args.seed)
    backends = [args.backend] + (["plain"] if args.compare_plain and args.backend != "plain" else [])
    walls: dict[str, float] = {}
    runs: dict[str, list[Request]] = {}
    decisions: str | None = None
    for backend in backends:
        engine, requests = _build(args, target, backend)
        start = time.perf_counter()
        outputs = engine.run()
        wall = time.perf_counter() - start
        walls[backend], runs[backend] = wall, requests
        if backend == args.backend and engine.draft_policy is not None:
            decisions = engine.metrics.decisions
        tokens = sum(len(o) for o in outputs.values())
        if args.json:
            continue
        if backend == args.backend:
            for rid, out in outputs.items():
                print(f"{rid}: {' '.join(map(str, out))}")
        print(_summary(backend, engine.metrics, tokens, wall, adaptive=engine.draft_policy is not None))
    if args.json:
        for i, req in enumerate(runs[args.backend]):
            record = _tiny_json(args.backend, req, walls[args.backend], decisions)
            if "plain" in runs and args.backend != "plain":
                record["plain"] = {"same_tokens": list(runs["plain"][i].output) == record["token_ids"]}
            emit_json(record)
        return 0
    if len(walls) == 2:
        print(
            f"speed vs plain decoding: {walls['plain'] / walls[args.backend]:.2f}x "
            "(random tiny target: unless the drafter is the target itself, drafts rarely agree)"
        )
    print(
        f"contracts: {args.contracts}; random tiny target ({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})"
    )
    return 0


def _tiny_json(backend: str, req: Request, wall: float, decisions: str | None) -> dict[str, Any]:
    """One request of the random tiny target; its "text" is the token ids as the text output prints them.

    ``decisions``: the adaptive draft length's trace of the batch the request ran in (``None`` at fixed).
    """
    tokens = list(req.output)
    reason = req.finish_reason
    return {
        "request_id": req.req_id,
        "backend": backend,
        "prompt_token_ids": list(req.prompt),
        "text": " ".join(map(str, tokens)),
        "token_ids": tokens,
        "finish_reason": FINISH[reason] if reason is not None else None,
        "metrics": {
            "tokens": len(tokens),
            **speculation_json(req.metrics),
            "batch_wall_s": round(wall, 4),
            "batch_decisions": decisions,
        },
    }


def run_model(args: argparse.Namespace) -> int:
    """``--model``: each prompt through ``specdec.LLM``, streamed to stdout and followed by its summary line.

    Everything but the generated text and the summary (pull progress, what was
    loaded) goes to stderr, so stdout is exactly text + newline + summary per
    prompt, or with ``--json`` one JSON object per prompt.
    """
    import torch

    import contracts
    from specdec.cli.streaming import drafter_weights_are_random, summary_line
    from specdec.hub import ModelStoreError, RichProgress, UnknownModelError, load
    from specdec.hub.local import is_path
    from specdec.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contracts.set_mode(args.contracts)
    start = time.perf_counter()
    try:
        target, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), reporter=RichProgress())
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from None
    except ModelStoreError as exc:
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 1
    prompts = [_encode(tokenizer, p, args.chat) for p in args.prompts]
    limit = target.config.max_model_len
    for p, ids in zip(args.prompts, prompts, strict=True):
        if len(ids) >= limit:
            which = "the prompt" if p.line == 0 else f"the prompt on line {p.line}"
            raise UsageError(f"{which} has {len(ids)} tokens; the model's context is {limit}")
    sizes = ", ".join(str(len(ids)) for ids in prompts[:8]) + (", ..." if len(prompts) > 8 else "")
    print(
        f"{args.model}: loaded in {time.perf_counter() - start:.1f} s; "
        f"prompt{'s' if len(prompts) > 1 else ''} {sizes} tokens "
        f"({'chat template' if args.chat else 'raw text'}); {args.dtype}; contracts {args.contracts}; "
        f"{torch.get_num_threads()} thread(s)",
        file=sys.stderr,
    )
    # Shipped drafter weights are per catalog model; a model given by path has none.
    catalog = None if is_path(args.model) else args.model
    if args.backend_options:  # the factory sees its -O values once here, so a refusal is reported as the user's
        with _option_errors(args):
            _speculator(args, target)
    llm = LLM.from_model(
        target,
        tokenizer,
        speculative_config=speculative_config(args, target),
        catalog_model=catalog,
        seed=args.seed,
        max_num_seqs=1,
        draft_length=args.draft_length,
    )
    plain = LLM.from_model(target, tokenizer, seed=args.seed, max_num_seqs=1)
    compare = args.compare_plain and args.backend != "plain"

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    for i, (prompt, ids) in enumerate(zip(args.prompts, prompts, strict=True)):
        params = args.params.model_copy(update={"seed": args.seed + i})
        result = llm.stream(ids, params, on_text=None if args.json else write)
        if i == 0 and llm.drafter_notice is not None:
            print(f"specdec generate: {llm.drafter_notice}", file=sys.stderr)
        baseline = plain.stream(ids, params) if compare else None
        random_drafter = drafter_weights_are_random(llm.last_speculator, target)
        if args.json:
            emit_json(_model_json(args.backend, prompt, result, baseline, random_drafter, llm.draft_policy is not None))
            continue
        sys.stdout.write("\n")
        line = summary_line(
            args.backend,
            _as_stream_result(result),
            random_drafter=random_drafter,
            plain=None if baseline is None else _as_stream_result(baseline),
            adaptive=llm.draft_policy is not None,
        )
        print(line, flush=True)
    return 0


def _encode(tokenizer: Any, prompt: FilePrompt, chat: bool) -> list[int]:
    """A conversation always goes through the chat template; text does when ``--chat`` (the default) is on."""
    if prompt.messages is not None:
        return list(tokenizer.encode_chat(prompt.messages))
    assert prompt.text is not None
    return list(
        tokenizer.encode_chat([{"role": "user", "content": prompt.text}]) if chat else tokenizer.encode(prompt.text)
    )


def _as_stream_result(streamed: StreamedOutput) -> Any:
    from specdec.cli.streaming import StreamResult

    completion = streamed.output.outputs[0]
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return StreamResult(
        tokens=list(completion.token_ids),
        text=completion.text,
        chunks=streamed.chunks,
        finish_reason=streamed.finish,
        wall_s=streamed.wall_s,
        first_token_s=streamed.first_token_s,
        metrics=streamed.run_metrics,
        stop_string=stop,
    )


def _model_json(
    backend: str,
    prompt: FilePrompt,
    result: StreamedOutput,
    plain: StreamedOutput | None,
    random_drafter: bool,
    adaptive: bool,
) -> dict[str, Any]:
    completion = result.output.outputs[0]
    m = result.run_metrics
    tokens = len(completion.token_ids)
    record: dict[str, Any] = {
        "prompt": prompt.shown,
        "backend": backend,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "metrics": {
            "tokens": tokens,
            "steps": m.steps,
            **speculation_json(m),
            "tokens_per_s": round(tokens / result.wall_s, 3) if result.wall_s > 0 else None,
            "wall_s": round(result.wall_s, 4),
            "first_token_s": round(result.first_token_s, 4),
            "decisions": m.decisions if adaptive else None,
        },
        "random_drafter": random_drafter,
    }
    if plain is not None:
        plain_tokens = len(plain.output.outputs[0].token_ids)
        plain_rate = plain_tokens / plain.wall_s if plain.wall_s > 0 else 0.0
        rate = record["metrics"]["tokens_per_s"] or 0.0
        record["plain"] = {
            "same_tokens": plain.output.outputs[0].token_ids == completion.token_ids,
            "tokens_per_s": round(plain_rate, 3),
            "speedup": round(rate / plain_rate, 4) if plain_rate else None,
        }
    return record
