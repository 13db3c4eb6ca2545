"""``specdec generate``: run the engine on a random tiny target and print tokens and metrics.

Token ids in, token ids out until real models and tokenizers arrive; the point
is the run itself: every step checked in the chosen contract mode, optionally on
several in-process DP ranks, with speculation metrics beside plain decoding.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from specdec.backend_registry import create
from specdec.engine import Engine, EngineConfig, RunMetrics
from specdec.model.config import ModelConfig
from specdec.model.transformer import Transformer
from specdec.sampling import SamplingParams
from specdec.scheduler import SchedulerConfig
from specdec.speculator import Speculator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="1 2 3 4 5 6 7 8", help="prompt token ids, space separated")
    p.add_argument(
        "--backend",
        default="eagle",
        help="'plain', an installed backend (entry point group specdec.backends: eagle, draft-model, dflash, "
        "dspark, ...) or a 'module:factory' spec",
    )
    p.add_argument("--num-spec-tokens", "-k", type=int, default=4)
    p.add_argument("--fused", action="store_true", help="fused multi-step decode (metadata built once)")
    p.add_argument("--draft-is-target", action="store_true", help="draft-model backend drafting with the target itself")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contracts", choices=["off", "shapes", "full"], default="shapes")
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the ratio")
    p.add_argument("--layers", type=int, default=4, help="layers of the random tiny target")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the random tiny target")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny models run best on one)")


def _build(args: argparse.Namespace, target: Transformer, backend: str) -> Engine:
    speculator: Speculator | None = None
    if backend != "plain":
        # Options a backend may not know are passed only when asked for, so a strict factory fails loudly then.
        options: dict[str, Any] = {"num_spec_tokens": args.num_spec_tokens}
        if args.fused:
            options["fused"] = True
        if args.draft_is_target:
            options["draft"] = target
        speculator = create(backend, target, **options)
    config = EngineConfig(
        num_blocks=1024,
        block_size=16,
        seed=args.seed,
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024),
    )
    engine = Engine(target, config, speculator=speculator)
    prompt = [int(t) for t in args.prompt.split()]
    params = SamplingParams(temperature=float(args.temperature))
    for i in range(args.num_requests):
        engine.add_request(
            f"req-{i}", [(t + i) % target.config.vocab_size for t in prompt], params=params, max_tokens=args.max_tokens
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


def run(args: argparse.Namespace) -> int:
    import torch

    import contracts

    torch.set_num_threads(args.threads)
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
