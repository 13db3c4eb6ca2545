"""``specdec train``: build a real target's training features, train a drafter, measure tau.

Three steps, each a subcommand, so one feature file (the expensive target
pass) serves all three drafters::

    specdec train features --model smollm2-135m-instruct --out feats.safetensors
    specdec train drafter --backend eagle --features feats.safetensors --steps 600 \\
        --out backends/weights/smollm2-135m-instruct/eagle.safetensors
    specdec train tau --model smollm2-135m-instruct --backend eagle

``specdec`` finds this command through the ``specdec.commands`` entry point;
``python -m backends.training.cli`` runs the same parser (``train`` is an
alias of ``drafter``, the name older model cards record).

Step counts are fixed (never a time limit), so a run is reproducible from its
command line; wall time is printed and recorded in the weights' metadata.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BACKENDS = ("eagle", "dflash", "dspark")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """Every layer any built-in drafter injects: EAGLE's three and DFlash/DSpark's five."""
    from backends.registry import spread_layers

    return tuple(sorted(set(spread_layers(num_layers)) | set(spread_layers(num_layers, count=5))))


def generation_progress(suite: str, done: int, total: int) -> None:
    log(f"{suite}: generated {done}/{total}")


def feature_progress(done: int, total: int) -> None:
    if done % 100 == 0 or done == total:
        log(f"features {done}/{total}; {resident_memory()}")


def resident_memory() -> str:
    """This process's resident memory (Linux), for logs of long runs; empty elsewhere."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/self/status") if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return ""


def prompt_sets(args: argparse.Namespace) -> list[tuple[str, tuple[Any, ...]]]:
    """The prompts whose greedy answers ``features`` generates, by source; sources with no prompt left out."""
    from specdec.corpora import SUITES, code_explanation_prompts, code_instruction_prompts, prompt_suite

    sets = [
        (f"{suite} (train split)", prompt_suite(suite, split="train")[: args.prompts_per_suite]) for suite in SUITES
    ]
    if args.code_prompts:
        skip = args.code_skip
        code = code_instruction_prompts(limit=skip + args.code_prompts)[skip:]
        sets.append(("stdlib code prompts" + (f" from #{skip}" if skip else ""), code))
    if args.explain_prompts:
        sets.append(("stdlib explain prompts", code_explanation_prompts(limit=args.explain_prompts)))
    return [(name, prompts) for name, prompts in sets if prompts]


def build_windows(args: argparse.Namespace, target: Any, tokenizer: Any) -> tuple[torch.Tensor, list[str]]:
    """Corpus windows and target continuations of the train-split prompts, as one batch of token windows."""
    from backends.training.corpus import generated_chunks, greedy_continuations, text_chunks
    from specdec.corpora import training_texts

    stop = tokenizer.stop_token_ids
    eos = tokenizer.eos_token_id
    parts = (
        text_chunks(
            tokenizer,
            training_texts(),
            seq_len=args.seq_len,
            per_group=args.text_per_group,
            per_document=args.per_document,
            seed=0,
        )
        if args.text_per_group
        else []  # a stage's new data may be answers only
    )
    for part in parts:
        log(part.summary)
    for name, prompts in prompt_sets(args):
        ids = [
            tokenizer.encode_chat([{"role": "user", "content": p.text}]) if p.chat else tokenizer.encode(p.text)
            for p in prompts
        ]
        t0 = time.perf_counter()
        seqs = greedy_continuations(
            target,
            ids,
            max_tokens=args.gen_tokens,
            stop_token_ids=stop,
            batch=args.gen_batch,
            progress=functools.partial(generation_progress, name),
        )
        part = generated_chunks(name, seqs, seq_len=args.seq_len, eos=eos, limit=args.gen_limit)
        log(f"{part.summary} in {time.perf_counter() - t0:.0f} s; {resident_memory()}")
        parts.append(part)
    return torch.cat([p.tokens for p in parts]), [p.summary for p in parts]


def cmd_features(args: argparse.Namespace) -> int:
    import contracts
    from backends.training.data import target_features
    from specdec.cli.errors import UsageError
    from specdec.hub import load

    sources = (args.text_per_group, args.prompts_per_suite != 0, args.code_prompts, args.explain_prompts)
    if not any(sources) and not args.reuse_tokens:
        raise UsageError(
            "no windows to build: --text-per-group, --prompts-per-suite, --code-prompts and --explain-prompts "
            "are all 0; expected at least one source"
        )
    contracts.set_mode("off")
    start = time.perf_counter()
    target, tokenizer = load(args.model, dtype=DTYPES[args.dtype])
    tokens_file = Path(str(args.out) + ".tokens.safetensors")
    if args.reuse_tokens and tokens_file.is_file():
        tokens = load_file(str(tokens_file))["tokens"]
        with safe_open(str(tokens_file), framework="pt") as f:
            summary = list(json.loads((f.metadata() or {})["summary"]))
        log(f"reusing {len(tokens)} windows from {tokens_file}")
    else:
        tokens, summary = build_windows(args, target, tokenizer)
        tokens_file.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": tokens.contiguous()}, str(tokens_file), metadata={"summary": json.dumps(summary)})
    log(f"{len(tokens)} sequences of {args.seq_len} tokens; running the target over them")
    feats = target_features(
        target,
        tokens,
        feature_layers(target.config.num_layers),
        top_k=args.top_k,
        aux_dtype=torch.bfloat16,
        progress=feature_progress,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    feats.save(out, {"model": args.model, "summary": json.dumps(summary)})
    agree = float((feats.greedy_next[:, :-1] == feats.tokens[:, 1:]).float().mean())
    log(f"wrote {out} in {time.perf_counter() - start:.0f} s; text/target agreement {agree:.3f}")
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The command that ran, for a file's record (the arguments the parser got, files named without machine paths)."""
    from backends.training.record import command_line as recorded

    return recorded(args.prog, args.argv)


def features_model(paths: Sequence[str]) -> str:
    """The model every feature file was computed with (read from the metadata alone, before any tensor)."""
    from specdec.cli.errors import UsageError

    models = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            models[path] = (f.metadata() or {}).get("model")
    if None in models.values() or len(set(models.values())) != 1:
        raise UsageError(f"--features files must all be feature files of one model; their models: {models}")
    return str(next(iter(models.values())))


def load_features(paths: Sequence[str], aux_layers: Sequence[int] | None = None) -> tuple[list[str], Any]:
    """The files' windows as one set (each narrowed to ``aux_layers`` first, to hold less) and their summaries."""
    from backends.training.data import TargetFeatures

    parts, summary = [], []
    for path in paths:
        feats, meta = TargetFeatures.load(Path(path))
        parts.append(feats if aux_layers is None else feats.select(aux_layers))
        summary += list(json.loads(meta["summary"]))
        del feats
    return summary, TargetFeatures.concat(parts)


def cmd_train(args: argparse.Namespace) -> int:
    from backends.pretrained import load_drafter, meta_json, read_metadata, save_drafter
    from backends.registry import spread_layers
    from backends.training.data import TrainSchedule
    from specdec.hub import load

    schedule = TrainSchedule(  # before the slow loads, so a bad setting fails at once
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        batch_size=args.batch_size,
        warmup=args.warmup,
        clip=args.clip,
        autocast=DTYPES[args.dtype] if args.dtype != "fp32" else None,
        keep_top=args.keep_top,
        negatives=args.negatives,
    )
    torch.manual_seed(args.seed)
    model = features_model(args.features)
    target, _ = load(model)
    n = target.config.num_layers
    aux = spread_layers(n) if args.backend == "eagle" else spread_layers(n, count=5)
    summary, feats = load_features(args.features, aux)
    init: dict[str, Any] | None = None

    def warm_start(modules: dict[str, torch.nn.Module]) -> None:
        """``--init``: the earlier file's weights (all or nothing), and its training record for this one's."""
        nonlocal init
        if args.init is not None:
            path = Path(args.init)
            load_drafter(path, modules)
            meta = read_metadata(path)
            init = {"file": path.name, "training": meta_json(meta, "training", path), "command": meta.get("command")}
            log(f"continuing from {path}")

    start = time.perf_counter()
    checkpoint = train_checkpoint(args)
    if checkpoint is not None and checkpoint.path.exists():
        log(f"resuming from {checkpoint.path}")

    def on_step(step: int, loss: float) -> None:
        if step % args.log_every == 0 or step == schedule.steps:
            log(f"{args.backend} step {step}/{schedule.steps} loss {loss:.4f} ({time.perf_counter() - start:.0f} s)")

    modules: dict[str, torch.nn.Module]
    network: dict[str, Any] = {"aux_layers": list(aux), "num_spec_tokens": args.k}
    if args.backend == "eagle":
        from backends.autoregressive import EagleHead
        from backends.training.eagle import train_eagle

        head = EagleHead(target, num_aux=len(aux), seed=args.seed)
        modules = {"head": head}
        network["num_layers"] = 1
        warm_start(modules)
        losses = train_eagle(
            head,
            target,
            feats,
            schedule,
            depth=args.k,
            aux_layers=aux,
            loss_rows=args.loss_rows,
            on_step=on_step,
            checkpoint=checkpoint,
        )
    else:
        from backends.dflash import DFlashNetwork
        from backends.training.dflash import train_dflash

        net = DFlashNetwork(target, num_aux=len(aux), seed=args.seed, num_layers=args.num_layers)
        network["num_layers"] = args.num_layers
        if args.backend == "dflash":
            modules = {"network": net}
            warm_start(modules)
            losses = train_dflash(
                net,
                target,
                feats,
                schedule,
                block_size=args.k + 1,
                anchors_per_seq=args.anchors,
                aux_layers=aux,
                on_step=on_step,
                checkpoint=checkpoint,
            )
        else:
            from backends.dspark import DSparkHeads
            from backends.training.dspark import train_dspark

            c = target.config
            heads = DSparkHeads(c.hidden_size, c.vocab_size, rank=args.rank, seed=args.seed, markov_scale=0.0)
            modules = {"network": net, "heads": heads}
            network["rank"] = args.rank
            warm_start(modules)
            losses = train_dspark(
                net,
                heads,
                target,
                feats,
                schedule,
                block_size=args.k,
                anchors_per_seq=args.anchors,
                aux_layers=aux,
                on_step=on_step,
                checkpoint=checkpoint,
            )
    wall = time.perf_counter() - start if checkpoint is None else checkpoint.wall_s()
    tail = losses[-min(50, len(losses)) :]
    final = sum(tail) / len(tail)
    training = {
        "steps": schedule.steps,
        "batch_size": schedule.batch_size,
        "lr": schedule.lr,
        "warmup": schedule.warmup,
        "clip": schedule.clip,
        "keep_top": schedule.keep_top,
        "negatives": schedule.negatives,
        "seed": schedule.seed,
        "dtype": args.dtype,
        "first_loss": round(losses[0], 4),
        "final_loss": round(final, 4),
        "final_loss_note": f"mean of the last {len(tail)} steps",
        "wall_s": round(wall),
        "threads": torch.get_num_threads(),
        "sequences": int(feats.tokens.shape[0]),
        "seq_len": int(feats.tokens.shape[1]),
    }
    if init is not None:
        training["continued_from"] = init
    meta = {
        "backend": args.backend,
        "model": model,
        "network": network,
        "training": training,
        "data": summary,
        "command": command_line(args),
    }
    vocab = None
    if args.draft_vocab:
        vocab, training["draft_vocab"] = draft_vocab_of(feats, args.draft_vocab, target.config.vocab_size)
    size = save_drafter(Path(args.out), modules, meta, draft_vocab=vocab)
    log(f"wrote {args.out} ({size / 1e6:.1f} MB): {json.dumps(training)}")
    if args.losses:
        Path(args.losses).write_text(json.dumps(losses))
    if checkpoint is not None and checkpoint.path.exists():
        checkpoint.path.unlink()  # the run is complete: OUT is its result, and a rerun starts afresh
    return 0


NOT_THE_RUN = {"out", "losses", "log_every", "checkpoint", "checkpoint_every", "threads", "argv", "prog", "run", "func"}
"""Arguments that do not change what a run computes: a checkpoint of the run may be resumed with others."""


def train_checkpoint(args: argparse.Namespace) -> Any:
    """The run's ``TrainCheckpoint`` (None with ``--checkpoint-every 0``), identified by what it computes."""
    from backends.training.checkpoint import TrainCheckpoint

    if args.checkpoint_every == 0:
        return None
    path = Path(args.checkpoint) if args.checkpoint else Path(args.out).with_suffix(".checkpoint.safetensors")
    identity = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_THE_RUN and not callable(v)}
    names = [Path(f).name for f in args.features]
    identity["features"] = names[0] if len(names) == 1 else names
    if args.init is not None:
        identity["init"] = Path(args.init).name
    return TrainCheckpoint(path, every=args.checkpoint_every, identity=identity)


def draft_vocab_of(feats: Any, size: int, vocab_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The ``size`` most frequent greedy labels of the features, and what it covers (for the file's record)."""
    from backends.draft_vocab import coverage, most_frequent

    ids = most_frequent(feats.greedy_next, size, vocab_size)
    covered = coverage(ids, feats.greedy_next, vocab_size)
    log(f"draft vocabulary: {len(ids)} tokens covering {covered:.4f} of the training labels")
    return ids, {"size": len(ids), "label_coverage": round(covered, 4)}


def cmd_vocab(args: argparse.Namespace) -> int:
    """Rewrite a drafter file with a draft vocabulary: same tensors, same metadata plus the vocabulary's record."""
    from backends.pretrained import DRAFT_VOCAB, read_metadata, write_card
    from specdec.hub import load

    path = Path(args.file)
    meta = read_metadata(path)
    model = features_model([args.features])
    _, feats = load_features([args.features], aux_layers=())
    if meta.get("model") != model:
        raise ValueError(f"{path} is a drafter for {meta.get('model')!r}, the features are of {model!r}")
    target, _ = load(model)
    tensors = {k: v for k, v in load_file(str(path)).items() if k != DRAFT_VOCAB}
    training = json.loads(meta["training"])
    ids, training["draft_vocab"] = draft_vocab_of(feats, args.size, target.config.vocab_size)
    meta["training"] = json.dumps(training)
    meta["vocab_command"] = command_line(args)
    tensors[DRAFT_VOCAB] = ids.to(torch.int32).contiguous()
    save_file(tensors, str(path), metadata=meta)
    write_card(path)  # the file changed: its card must match it again
    log(f"wrote {path} with a draft vocabulary of {len(ids)} tokens")
    return 0


def cmd_tau(args: argparse.Namespace) -> int:
    import contracts
    from backends.training.evaluate import measure_tau
    from specdec.cli.lists import comma_list
    from specdec.corpora import prompt_suite
    from specdec.hub import load

    contracts.set_mode("off")
    target, tokenizer = load(args.model)
    result: dict[str, Any] = {"backend": args.backend, "weights": args.weights, "full_vocab": args.full_vocab}
    for suite in comma_list(args.suites):
        prompts = prompt_suite(suite)[: args.prompts]
        ids = [
            tokenizer.encode_chat([{"role": "user", "content": p.text}]) if p.chat else tokenizer.encode(p.text)
            for p in prompts
        ]
        pretrained = None if args.weights == "random" else (args.weights or args.model)
        result[suite] = round(
            measure_tau(
                target,
                ids,
                args.backend,
                pretrained=pretrained,
                k=args.k,
                max_tokens=args.max_tokens,
                full_vocab=args.full_vocab,
            ),
            3,
        )
        log(f"{args.backend} {suite}: tau {result[suite]}")
    print(json.dumps(result))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The steps as subcommands of ``parser``: ``specdec train`` (entry point ``specdec.commands``) or ``main``."""
    from specdec.cli.argtypes import int_in, positive_int

    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    sub = parser.add_subparsers(dest="step", required=True, metavar="{features,drafter,tau,vocab}")

    f = sub.add_parser("features", help="generate target continuations and run the target over the corpus")
    f.add_argument("--model", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--reuse-tokens", action="store_true", help="reuse OUT.tokens.safetensors windows of an earlier run")
    f.add_argument("--seq-len", type=int, default=256)
    f.add_argument(
        "--text-per-group", type=int_in(0), default=200, help="windows per corpus (stdlib, Shakespeare, ...; 0: none)"
    )
    f.add_argument("--per-document", type=int, default=8, help="windows from one long document at most")
    f.add_argument(
        "--prompts-per-suite", type=int_in(0), default=None, help="train-split prompts per suite (default all; 0: none)"
    )
    f.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens generated per prompt at most")
    f.add_argument("--gen-limit", type=int, default=400, help="windows of generated text per suite at most")
    f.add_argument("--gen-batch", type=int, default=16)
    f.add_argument(
        "--code-prompts", type=int, default=0, help="also continue this many stdlib function prompts (HumanEval form)"
    )
    f.add_argument(
        "--code-skip", type=int_in(0), default=0, help="start --code-prompts after this many (new data for a stage)"
    )
    f.add_argument(
        "--explain-prompts",
        type=int_in(0),
        default=0,
        help="also answer this many 'explain this stdlib function' chat prompts (prose chat data)",
    )
    f.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="target dtype (generation and features)")
    f.add_argument("--top-k", type=int, default=8, help="target probabilities kept per position (DSpark's TV)")
    f.set_defaults(run=cmd_features)

    t = sub.add_parser(
        "drafter", aliases=["train"], help="train one drafter on a feature file and write its safetensors and card"
    )
    t.add_argument("--backend", choices=BACKENDS, required=True)
    t.add_argument(
        "--features", required=True, action="append", help="a feature file; repeat it to train on several as one"
    )
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--k", type=int, default=4, help="draft tokens the drafter is trained for")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--clip", type=float, default=1.0, help="gradient-norm cap")
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="autocast of the forward")
    t.add_argument("--loss-rows", type=int, default=None, help="EAGLE: rows scored per batch (default all)")
    t.add_argument("--keep-top", type=int, default=None, help="score against data tokens + target top-N only")
    t.add_argument("--negatives", type=int, default=0, help="with --keep-top: random other LM-head rows per batch")
    t.add_argument("--anchors", type=int, default=32, help="DFlash/DSpark: anchors per sequence")
    t.add_argument("--num-layers", type=int, default=1, help="DFlash/DSpark decoder layers")
    t.add_argument("--rank", type=int, default=32, help="DSpark Markov head rank")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument(
        "--init", default=None, help="continue from this drafter file (same network) instead of fresh weights"
    )
    t.add_argument("--losses", default=None, help="also write the per-step losses here (JSON)")
    t.add_argument(
        "--draft-vocab", type=int, default=0, help="score drafts over the N most frequent target labels (0: all)"
    )
    t.add_argument(
        "--checkpoint",
        default=None,
        help="save the whole training state here every --checkpoint-every steps, and resume from it when it exists "
        "(default: OUT with .checkpoint.safetensors; deleted once OUT is written)",
    )
    t.add_argument(
        "--checkpoint-every", type=int_in(0), default=100, help="steps between two checkpoints (0: no checkpoint)"
    )
    t.set_defaults(run=cmd_train)

    m = sub.add_parser("tau", help="acceptance length on held-out bench prompts (greedy)")
    m.add_argument("--model", required=True)
    m.add_argument("--backend", choices=BACKENDS, required=True)
    m.add_argument("--weights", default=None, help="'random', a .safetensors path, or default: the shipped ones")
    m.add_argument("--suites", default="humaneval,mtbench,shakespeare")
    m.add_argument("--prompts", type=int, default=8)
    m.add_argument("--max-tokens", type=int, default=64)
    m.add_argument("--k", type=int, default=4)
    m.add_argument("--full-vocab", action="store_true", help="score drafts over the whole LM head, not the file's")
    m.set_defaults(run=cmd_tau)

    v = sub.add_parser("vocab", help="give a drafter file the draft vocabulary of a feature file (weights unchanged)")
    v.add_argument("--features", required=True)
    v.add_argument("--file", required=True, help="the drafter .safetensors to rewrite")
    v.add_argument("--size", type=int, required=True, help="the most frequent target labels kept")
    v.set_defaults(run=cmd_vocab)
    parser.set_defaults(func=run_step, prog=parser.prog)


def check_inputs(args: argparse.Namespace) -> None:
    """The files and the model a step reads exist before anything expensive starts (a mistake is a usage error)."""
    from specdec.cli.errors import UsageError, check_model

    for option in ("features", "file", "init"):
        value = getattr(args, option, None)
        for path in value if isinstance(value, list) else [value]:
            if path is not None and not Path(path).is_file():
                raise UsageError(f"--{option} {path}: no such file")
    weights = getattr(args, "weights", None)
    if weights not in (None, "random") and not Path(weights).is_file():
        raise UsageError(f"--weights {weights}: no such file; expected 'random', a .safetensors path, or nothing")
    if getattr(args, "model", None) is not None:
        check_model(args.model)
    out = getattr(args, "out", None)
    if out is not None and Path(out).is_dir():
        raise UsageError(f"--out {out} is a folder; expected the path of the file to write")


def run_step(args: argparse.Namespace) -> int:
    """Run the chosen step; ``args.argv`` (the command's own arguments) is what a written file records."""
    check_inputs(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    code: int = args.run(args)
    return code


def main(argv: list[str] | None = None) -> int:
    from specdec.cli.errors import EXIT_USAGE, UsageError, report

    parser = argparse.ArgumentParser(prog="python -m backends.training.cli", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run_step(args)
    except UsageError as exc:
        report(str(exc))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
