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
from typing import Any

from specdec.backend_registry import create, names_option
from specdec.engine import Engine, EngineConfig, RunMetrics
from specdec.nn.config import ModelConfig
from specdec.nn.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator

TINY_PROMPT = "1 2 3 4 5 6 7 8"
REAL_PROMPT = "Write a Python function that reverses a string."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help=f"with --model: the prompt text (default {REAL_PROMPT!r}); without: token ids, space separated "
        f"(default {TINY_PROMPT!r})",
    )
    p.add_argument(
        "--model",
        help="a model from `specdec models list` (pulled on first use), a Llama GGUF file, or a checkpoint directory "
        "(config.json, tokenizer.json, safetensors); without it, a random tiny target runs",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --model: wrap the prompt in the model's chat template as a user message (default on)",
    )
    p.add_argument(
        "--backend",
        default="eagle",
        help="'plain', an installed backend (entry point group specdec.backends: eagle, draft-model, dflash, "
        "dspark, ...) or a 'module:factory' spec",
    )
    p.add_argument(
        "--pretrained",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --model: load the backend's trained drafter weights for that model where it ships them "
        "(default on; a backend without them drafts with random weights)",
    )
    p.add_argument("--num-spec-tokens", "-k", type=int, default=4)
    p.add_argument("--fused", action="store_true", help="fused multi-step decode (metadata built once)")
    p.add_argument("--draft-is-target", action="store_true", help="draft-model backend drafting with the target itself")
    p.add_argument("--num-requests", type=int, default=4, help="random tiny target only (--model runs one request)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (default 32; --model: 256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--contracts",
        choices=["off", "shapes", "full"],
        default=None,
        help="contract mode (default: $SPECDEC_CONTRACTS when set, else shapes)",
    )
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the ratio")
    p.add_argument("--layers", type=int, default=4, help="layers of the random tiny target")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the random tiny target")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="with --model: the target's dtype (bfloat16 is much faster on CPUs with AMX or AVX512-BF16)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 for the tiny target, which runs best on one; torch's default with "
        "--model)",
    )


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
    prompt = [int(t) for t in (args.prompt or TINY_PROMPT).split()]
    params = SamplingParams(temperature=float(args.temperature))
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
    if max_tokens < 1:
        print(f"specdec generate: --max-tokens must be >= 1, got {max_tokens}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        target, tokenizer = load(args.model, dtype=getattr(torch, args.dtype), reporter=RichProgress())
    except (ModelStoreError, UnknownModelError) as exc:
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 1
    text = REAL_PROMPT if args.prompt is None else args.prompt
    prompt = tokenizer.encode_chat([{"role": "user", "content": text}]) if args.chat else tokenizer.encode(text)
    print(
        f"{args.model}: loaded in {time.perf_counter() - start:.1f} s; prompt {len(prompt)} tokens "
        f"({'chat template' if args.chat else 'raw text'}); {args.dtype}; contracts {args.contracts}; "
        f"{torch.get_num_threads()} thread(s)",
        file=sys.stderr,
    )
    params = SamplingParams(temperature=float(args.temperature))
    from specdec.hub.local import is_path

    # Shipped drafter weights are per catalog model; a model given by path has none.
    speculator = _speculator(args, target, args.backend, model=None if is_path(args.model) else args.model)
    try:
        engine = engine_for(target, len(prompt), max_tokens, speculator=speculator, seed=args.seed)
    except ValueError as exc:  # a prompt longer than the model's context
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 2

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
