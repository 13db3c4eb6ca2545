"""The ``specdec`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


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
    for column in ("ID", "tag", "statement", "step kinds", "wired"):
        table.add_column(column, overflow="fold")
    for inv in invs:
        kinds = ", ".join(sorted(k.value for k in inv.step_kinds))
        table.add_row(inv.id, inv.tag.value, inv.statement, kinds, "yes" if inv.wired else "not yet")
    Console(width=160).print(table)


def _bench_contracts(args: argparse.Namespace) -> int:
    from specdec.bench_contracts import main as bench_main

    return bench_main(repeats=args.repeats, num_reqs=args.num_reqs, query_len=args.query_len)


def _generate(args: argparse.Namespace) -> int:
    from specdec.generate import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Contract-checked speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("contracts", help="print the contract catalog from the invariant registry")
    p.add_argument("--format", choices=["table", "text", "markdown"], default="table")
    p.add_argument("--write", metavar="PATH", help="write the markdown catalog (docs/contracts.md)")
    p.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the generated catalog")
    p.set_defaults(func=_contracts)

    from specdec.generate import add_arguments

    g = sub.add_parser("generate", help="run the engine (random tiny target) and print tokens and metrics")
    add_arguments(g)
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench-contracts", help="measure the cost of each contract mode per step boundary")
    b.add_argument("--repeats", type=int, default=2000)
    b.add_argument("--num-reqs", type=int, default=64)
    b.add_argument("--query-len", type=int, default=4, help="tokens per request (decode 1, verify K+1)")
    b.set_defaults(func=_bench_contracts)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
