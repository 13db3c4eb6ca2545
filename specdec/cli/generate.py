"""``specdec generate``: run the engine and print what it generated, with speculation metrics.

Two modes. With ``--model NAME`` a real model from the store (pulled on first
use) answers a text prompt: the chat template is applied by default, text is
streamed as the engine accepts tokens, generation stops at the model's stop
tokens, and one summary line ends the output. Without it, a random tiny target
takes token ids and prints token ids for several requests (the contract
exercise: every step checked in the chosen mode, speculation metrics beside
plain decoding).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specdec.backend_registry import create, names_option
from specdec.cli.argtypes import float_in, positive_int, seed
from specdec.cli.errors import UsageError, check_backend, check_text
from specdec.engine import Engine, EngineConfig, RunMetrics
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

TINY_PROMPT = "1 2 3 4 5 6 7 8"
REAL_PROMPT = "Write a Python function that reverses a string."


TINY_ONLY = {"num_requests": "--num-requests", "layers": "--layers", "hidden": "--hidden"}
"""Options of the random tiny target: given with ``--model`` they are mistakes, not silently ignored."""
MODEL_ONLY = {"chat": "--chat/--no-chat", "pretrained": "--pretrained/--no-pretrained", "dtype": "--dtype"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help=f"with --model: the prompt text (default: {REAL_PROMPT!r}); without: token ids, space separated "
        f"(default: {TINY_PROMPT!r})",
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
        default="eagle",
        help="'plain', an installed backend (entry point group specdec.backends: eagle, draft-model, dflash, "
        "dspark, ...) or a 'module:factory' spec (default: eagle)",
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
    if args.backend == "plain":
        extra = [f for f, on in (("-k", args.num_spec_tokens is not None), ("--fused", args.fused)) if on]
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
    if args.temperature == 0.0 and (args.top_k is not None or args.top_p is not None):
        raise UsageError("--top-k and --top-p shape sampling; with --temperature 0 (greedy) they would be ignored")
    args.num_spec_tokens = 4 if args.num_spec_tokens is None else args.num_spec_tokens
    args.params = sampling_params(args)
    if args.model is None:
        args.num_requests = 4 if args.num_requests is None else args.num_requests
        args.layers = 4 if args.layers is None else args.layers
        args.hidden = 64 if args.hidden is None else args.hidden
        if args.hidden % 4:
            raise UsageError(f"--hidden {args.hidden}: the tiny target has 4 heads, so a multiple of 4 is expected")
        args.tiny_prompt = tiny_prompt(args.prompt)
    else:
        from specdec.hub.local import is_path

        if is_path(args.model) and not Path(args.model).expanduser().exists():
            raise UsageError(f"--model {args.model}: no such file or directory")
        args.chat = True if args.chat is None else args.chat
        args.pretrained = True if args.pretrained is None else args.pretrained
        args.dtype = args.dtype or "float32"
        args.text = check_text(REAL_PROMPT if args.prompt is None else args.prompt, "the prompt")
        if not args.text:
            raise UsageError("the prompt is empty; give the text to answer (or leave it out for the default prompt)")


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


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(temperature=float(args.temperature), top_k=args.top_k, top_p=args.top_p)
    except ValidationError as exc:  # e.g. a temperature below the smallest float32 normal
        raise UsageError("; ".join(f"--{'-'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def _speculator(
    args: argparse.Namespace, target: Transformer, backend: str, model: str | None = None
) -> Speculator | None:
    if backend == "plain":
        return None
    # Options a backend may not know are passed only when asked for, so a strict factory fails loudly then.
    options: dict[str, Any] = {"num_spec_tokens": args.num_spec_tokens}
    if args.fused:
        options["fused"] = True
    if args.draft_is_target:
        options["draft"] = target
    if model is not None and args.pretrained and names_option(backend, "pretrained"):
        try:  # the backend's trained weights for this model, where it ships them
            return create(backend, target, **options, pretrained=model)
        except FileNotFoundError as exc:  # this backend ships no weights for this model
            print(f"specdec generate: {exc}; drafting with random weights", file=sys.stderr)
    return create(backend, target, **options)


def _build(args: argparse.Namespace, target: Transformer, backend: str) -> Engine:
    speculator = _speculator(args, target, backend)
    config = EngineConfig(
        num_blocks=1024,
        block_size=16,
        seed=args.seed,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024),
    )
    engine = Engine(target, config, speculator=speculator)
    prompt = args.tiny_prompt
    params = args.params
    max_tokens = 32 if args.max_tokens is None else args.max_tokens
    for i in range(args.num_requests):
        engine.add_request(
            f"req-{i}", [(t + i) % target.config.vocab_size for t in prompt], params=params, max_tokens=max_tokens
        )
    return engine


def _summary(name: str, m: RunMetrics, tokens: int, wall: float) -> str:
    by_pos = ", ".join(f"{r:.2f}" for r in m.acceptance_rate_by_position) or "-"
    tau = f"{m.acceptance_length:.2f}" if m.verify_steps else "-"
    return (
        f"{name:<12} tokens {tokens:5d}  steps {m.steps:4d}  tokens/step {m.tokens_per_step:5.2f}  "
        f"drafted {m.drafted:5d}  accepted {m.accepted:5d}  tau {tau:>5}  "
        f"accept by position [{by_pos}]  {tokens / wall:8.1f} tok/s  ({wall:.2f} s)"
    )


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
    for backend in backends:
        engine = _build(args, target, backend)
        start = time.perf_counter()
        outputs = engine.run()
        wall = time.perf_counter() - start
        walls[backend] = wall
        tokens = sum(len(o) for o in outputs.values())
        if backend == args.backend:
            for rid, out in outputs.items():
                print(f"{rid}: {' '.join(map(str, out))}")
        print(_summary(backend, engine.metrics, tokens, wall))
    if len(walls) == 2:
        print(
            f"speed vs plain decoding: {walls['plain'] / walls[args.backend]:.2f}x "
            "(random tiny target: unless the drafter is the target itself, drafts rarely agree)"
        )
    print(
        f"contracts: {args.contracts}; random tiny target ({config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size})"
    )
    return 0


def run_model(args: argparse.Namespace) -> int:
    """``--model``: one text prompt on a real model, streamed to stdout, then the summary line.

    Everything but the generated text and the summary (pull progress, what was
    loaded) goes to stderr, so stdout is exactly text + newline + summary.
    """
    import torch

    import contracts
    from specdec.cli.streaming import drafter_weights_are_random, engine_for, stream_request, summary_line
    from specdec.hub import ModelStoreError, RichProgress, UnknownModelError, load

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contracts.set_mode(args.contracts)
    max_tokens = 256 if args.max_tokens is None else args.max_tokens
    start = time.perf_counter()
    try:
        target, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), reporter=RichProgress())
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from None
    except ModelStoreError as exc:
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 1
    text = args.text
    prompt = tokenizer.encode_chat([{"role": "user", "content": text}]) if args.chat else tokenizer.encode(text)
    print(
        f"{args.model}: loaded in {time.perf_counter() - start:.1f} s; prompt {len(prompt)} tokens "
        f"({'chat template' if args.chat else 'raw text'}); {args.dtype}; contracts {args.contracts}; "
        f"{torch.get_num_threads()} thread(s)",
        file=sys.stderr,
    )
    params = args.params
    from specdec.hub.local import is_path

    # Shipped drafter weights are per catalog model; a model given by path has none.
    speculator = _speculator(args, target, args.backend, model=None if is_path(args.model) else args.model)
    try:
        engine = engine_for(target, len(prompt), max_tokens, speculator=speculator, seed=args.seed)
    except ValueError as exc:  # a prompt longer than the model's context
        raise UsageError(str(exc)) from None

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with torch.inference_mode():
        result = stream_request(
            engine, tokenizer, prompt, params=params, max_tokens=max_tokens, on_text=write, seed=args.seed
        )
        plain = None
        if args.compare_plain and args.backend != "plain":
            baseline = engine_for(target, len(prompt), max_tokens, seed=args.seed)
            plain = stream_request(
                baseline,
                tokenizer,
                prompt,
                params=params,
                max_tokens=max_tokens,
                on_text=lambda _: None,
                seed=args.seed,
            )
    sys.stdout.write("\n")
    random_drafter = drafter_weights_are_random(speculator, target)
    print(summary_line(args.backend, result, random_drafter=random_drafter, plain=plain), flush=True)
    return 0
