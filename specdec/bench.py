"""``specdec bench``: plain decoding and every backend on fixed prompt suites, interleaved, in one process.

Per suite (HumanEval prompts, MT-Bench first turns, Shakespeare passages),
batch size (1 and 8) and temperature (greedy and 1), plain decoding and each
backend run the same prompts back to back, the order alternating between
rounds (``specdec.bench_runner``). Reported: tau, acceptance by draft
position, tokens/s and the speedup over plain decoding (median of the
per-round ratios); transformers ``generate`` on the same model as a peer of
plain decoding (``specdec.bench_peer``); greedy losslessness on every prompt
(``specdec.bench_lossless``); the cost of each contract mode
(``specdec.bench_contract_modes``). Writes ``bench.json``, ``bench.md`` and
two PNG plots; ``--write-docs`` refreshes ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import contracts
from specdec.backend_registry import create, names_option
from specdec.bench_contract_modes import MODES, ModeRunner
from specdec.bench_lossless import check_lossless, relative_tie_tolerance_for, tie_tolerance_for, top_two
from specdec.bench_report import HEADLINE_SUITE, Spread, evaluate_targets, render_markdown, round_noise, summarize
from specdec.bench_runner import PLAIN, EngineRunner, Runner, RunRecord, RunSpec, interleave, pair_ratios
from specdec.bench_suites import SUITES, Workload, build_workload
from specdec.model.transformer import Transformer
from specdec.speculator import Speculator

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_BACKENDS = ("eagle", "dflash", "dspark")
DOCS_PATH = "docs/benchmarks.md"
DOCS_BEGIN = "<!-- bench:begin (written by `specdec bench --write-docs`; do not edit by hand) -->"
DOCS_END = "<!-- bench:end -->"


@dataclass(frozen=True)
class BenchOptions:
    """Everything that shapes a bench run; ``command`` renders it back as the command line that reproduces it."""

    model: str = DEFAULT_MODEL
    suites: tuple[str, ...] = SUITES
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    k: int = 4
    max_tokens: int = 64
    singles: int = 4
    group_size: int = 8
    groups: int = 1
    batch_sizes: tuple[int, ...] = (1, 8)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    repeats: int = 2
    max_prompt_tokens: int = 512
    dtype: str = "float32"
    batch_invariant: bool = False
    threads: int | None = None
    weights: str = "auto"
    contracts: str = "off"
    contract_backend: str | None = None
    contract_prompts: int = 2
    peer: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.suites if s not in SUITES]
        if bad:
            raise ValueError(f"unknown suite(s) {bad}; known: {', '.join(SUITES)}")
        if not self.suites:
            raise ValueError("no suite given")
        if PLAIN in self.backends:
            raise ValueError(f"{PLAIN!r} always runs as the baseline; list only backends in --backends")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"a backend is listed twice: {list(self.backends)}")
        sizes_ok = all(b == 1 or b == self.group_size for b in self.batch_sizes)
        if not self.batch_sizes or not sizes_ok:
            raise ValueError(f"--batch-sizes may hold 1 and the group size {self.group_size}, got {self.batch_sizes}")
        checks = {
            "k": self.k >= 1,
            "max_tokens": self.max_tokens >= 1,
            "repeats": self.repeats >= 1,
            "singles": self.singles >= (1 if 1 in self.batch_sizes else 0),
            "groups": self.groups >= (1 if self.group_size in self.batch_sizes and self.group_size != 1 else 0),
            "contract_prompts": self.contract_prompts >= 0,
            "threads": self.threads is None or self.threads >= 1,
            "temperatures": bool(self.temperatures) and all(t >= 0 for t in self.temperatures),
        }
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(f"invalid bench options: {', '.join(wrong)} ({self})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.weights not in ("auto", "trained", "random"):
            raise ValueError(f"--weights must be auto, trained or random, got {self.weights!r}")
        if self.contract_backend is not None and self.contract_backend not in self.backends:
            raise ValueError(f"--contract-backend {self.contract_backend!r} is not among --backends {self.backends}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "float32" else torch.bfloat16

    @property
    def modes_backend(self) -> str | None:
        """Whose runs the contract modes are timed on: the one asked for, else DSpark if it runs, else the first."""
        if self.contract_backend is not None:
            return self.contract_backend
        if not self.backends:
            return None
        return "dspark" if "dspark" in self.backends else self.backends[0]

    def command(self) -> str:
        args = [
            "specdec",
            "bench",
            "--model",
            self.model,
            "--suites",
            ",".join(self.suites),
            "--backends",
            ",".join(self.backends) or "none",
            "-k",
            str(self.k),
            "--max-tokens",
            str(self.max_tokens),
            "--singles",
            str(self.singles),
            "--group-size",
            str(self.group_size),
            "--groups",
            str(self.groups),
            "--batch-sizes",
            ",".join(map(str, self.batch_sizes)),
            "--temperatures",
            ",".join(f"{t:g}" for t in self.temperatures),
            "--repeats",
            str(self.repeats),
            "--max-prompt-tokens",
            str(self.max_prompt_tokens),
            "--dtype",
            self.dtype,
            "--weights",
            self.weights,
            "--contracts",
            self.contracts,
            "--contract-prompts",
            str(self.contract_prompts),
            "--seed",
            str(self.seed),
        ]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.contract_backend is not None:
            args += ["--contract-backend", self.contract_backend]
        if not self.peer:
            args.append("--no-peer")
        if self.batch_invariant:
            args.append("--batch-invariant")
        return shlex.join(args)


QUICK: dict[str, Any] = {
    "max_tokens": 8,
    "singles": 1,
    "group_size": 2,
    "groups": 1,
    "batch_sizes": (1, 2),
    "repeats": 1,
    "contract_prompts": 1,
}
"""``--quick``: every code path once, in seconds per backend; figures are not meaningful."""


# -- drafters ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drafter:
    """How to build one backend's speculator for every run, and where its weights came from."""

    name: str
    options: dict[str, Any]
    weights_source: str
    note: str = ""

    def build(self, target: Transformer) -> Speculator:
        return create(self.name, target, **self.options)


def resolve_drafter(name: str, target: Transformer, *, k: int, weights: str, model: str) -> Drafter:
    """Trained weights shipped for ``model`` when asked (``auto``: when there are any), else freshly seeded ones.

    The speculator's own ``weights_source`` attribute is reported when it has
    one; otherwise whether it owns parameters beyond the target's.
    """
    from specdec.streaming import drafter_weights_are_random

    options: dict[str, Any] = {"num_spec_tokens": k}
    note = ""
    if weights != "random" and names_option(name, "pretrained"):
        try:
            speculator = create(name, target, **options, pretrained=model)
            options["pretrained"] = model
        except FileNotFoundError as exc:
            if weights == "trained":
                raise
            note = f"no trained weights, random ones used: {exc}"
            speculator = create(name, target, **options)
    else:
        if weights == "trained":
            raise ValueError(f"--weights trained: backend {name!r} takes no trained weights (no 'pretrained' option)")
        speculator = create(name, target, **options)
    declared = getattr(speculator, "weights_source", None)
    if isinstance(declared, str):
        source = declared
    else:
        source = "random" if drafter_weights_are_random(speculator, target) else "no weights of its own"
    return Drafter(name, options, source, note)


# -- the run -----------------------------------------------------------------------------------------------------


def _spread_dict(values: Sequence[float]) -> dict[str, Any] | None:
    spread = Spread.of(values)
    return None if spread is None else asdict(spread)


def _rate(records: Sequence[RunRecord]) -> float:
    wall = sum(r.wall_s for r in records)
    return sum(r.tokens for r in records) / wall if wall > 0 else 0.0


def peer_section(records: Sequence[RunRecord], peer_name: str) -> dict[str, Any]:
    """Engine plain vs the transformers peer: tokens/s ratios per round, per suite and overall, and token agreement."""
    mine = [r for r in records if r.runner in (PLAIN, peer_name)]
    suites = []
    for suite in dict.fromkeys(r.suite for r in mine):
        rs = [r for r in mine if r.suite == suite]
        engine = [r for r in rs if r.runner == PLAIN and r.batch_size == 1 and r.temperature == 0.0]
        peer = [r for r in rs if r.runner == peer_name]
        if not peer:
            continue
        rounds = {r.round_key: r for r in engine}
        agree = [rounds[p.round_key].outputs == p.outputs for p in peer if p.round_key in rounds]
        suites.append(
            {
                "suite": suite,
                "engine_tokens_per_s": _rate(engine),
                "transformers_tokens_per_s": _rate(peer),
                "engine_over_transformers": _spread_dict(pair_ratios(engine + peer, peer_name).get(PLAIN, [])),
                "same_tokens": sum(agree),
                "compared": len(agree),
            }
        )
    overall = pair_ratios([r for r in mine if r.batch_size == 1 and r.temperature == 0.0], peer_name).get(PLAIN, [])
    return {"status": "ok", "suites": suites, "engine_over_transformers": _spread_dict(overall)}


def contract_section(
    target: Transformer,
    workload: Workload,
    drafter: Drafter,
    options: BenchOptions,
    stop_token_ids: tuple[int, ...],
    on_run: Callable[[RunRecord], None],
) -> dict[str, Any]:
    """Each contract mode on the same prompts, interleaved; time relative to ``off`` and the share inside checks."""
    inner = EngineRunner(drafter.name, target, lambda: drafter.build(target))
    runners = [ModeRunner(inner, mode) for mode in MODES]
    spec = RunSpec(0.0, options.max_tokens, stop_token_ids, options.seed)
    batches = workload.singles[: options.contract_prompts]
    repeats = max(2, options.repeats)
    records = interleave(batches, runners, spec, repeats=repeats, on_run=on_run)
    ratios = pair_ratios(records, baseline="off")
    modes: dict[str, Any] = {}
    for runner in runners:
        rs = [r for r in records if r.runner == runner.name]
        modes[runner.name] = {
            "tokens_per_s": _rate(rs),
            # same greedy tokens in every mode, so time relative to off is the inverse of the rate ratio
            "time_vs_off": _spread_dict([1.0 / x for x in ratios.get(runner.name, []) if x > 0]),
            "check_fraction": statistics.median(runner.check_fractions) if runner.check_fractions else None,
            "check_calls": runner.check_calls,
        }
    same = len({tuple(map(tuple, r.outputs)) for r in records}) == 1
    return {
        "status": "ok",
        "backend": drafter.name,
        "suite": workload.suite,
        "prompts": len(batches),
        "repeats": repeats,
        "same_output_in_every_mode": same,
        "modes": modes,
    }


def environment(options: BenchOptions) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "dtype": options.dtype,
        "batch_invariant": options.batch_invariant,
        "model": options.model,
        "contracts": options.contracts,
    }


def run_bench(
    target: Transformer,
    workloads: Sequence[Workload],
    stop_token_ids: tuple[int, ...],
    options: BenchOptions,
    *,
    peer: Runner | None = None,
    peer_info: dict[str, Any] | None = None,
    peer_reason: str = "disabled (--no-peer)",
    on_run: Callable[[RunRecord], None] = lambda _: None,
) -> dict[str, Any]:
    """The whole bench on an already loaded target; returns the JSON report (without plots)."""
    drafters = {
        name: resolve_drafter(name, target, k=options.k, weights=options.weights, model=options.model)
        for name in options.backends
    }
    runners: list[Runner] = [EngineRunner(PLAIN, target)]
    for drafter in drafters.values():
        runners.append(EngineRunner(drafter.name, target, lambda d=drafter: d.build(target)))  # type: ignore[misc]
    if peer is not None:
        runners.append(peer)
    records: list[RunRecord] = []

    def collect(record: RunRecord) -> None:
        records.append(record)
        on_run(record)

    interrupted = False
    contract: dict[str, Any] = {"status": "skipped", "reason": "no backend, prompts or batch-1 runs for it"}
    previous = contracts.set_mode(options.contracts)
    try:
        try:
            warm_up(workloads, runners, stop_token_ids, options)
            for workload in workloads:
                for size in options.batch_sizes:
                    for temperature in options.temperatures:
                        spec = RunSpec(temperature, options.max_tokens, stop_token_ids, options.seed)
                        interleave(workload.batches(size), runners, spec, repeats=options.repeats, on_run=collect)
            modes_backend = options.modes_backend
            home = contract_workload(workloads)
            if modes_backend is not None and options.contract_prompts > 0 and home is not None:
                contract = contract_section(target, home, drafters[modes_backend], options, stop_token_ids, on_run)
        except KeyboardInterrupt:  # Ctrl-C: report the runs that finished (rounds cut short pair nothing)
            interrupted = True
            if contract["status"] != "ok":
                contract = {"status": "skipped", "reason": "interrupted"}
        prompt_ids = {p.id: p.ids for w in workloads for b in (*w.singles, *w.groups) for p in b.prompts}
        lossless = check_lossless(
            records,
            prompt_ids,
            lambda ids: top_two(target, ids),
            tie_tolerance=tie_tolerance_for(options.torch_dtype),
            relative_tolerance=relative_tie_tolerance_for(options.torch_dtype),
            skip=() if peer is None else (peer.name,),
        )
    finally:
        contracts.set_mode(previous)
    report: dict[str, Any] = {
        "command": options.command(),
        "interrupted": interrupted,
        "created_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "environment": environment(options),
        "config": {
            **{
                k: v
                for k, v in asdict(options).items()
                if k not in ("model", "dtype", "batch_invariant", "threads", "contracts")
            },
            "suites": list(options.suites),
            "backends": list(options.backends),
        },
        "drafters": {
            name: {"weights_source": d.weights_source, "options": d.options, "note": d.note}
            for name, d in drafters.items()
        },
        "workloads": {
            w.suite: {
                "prompts": [
                    {"id": p.id, "tokens": len(p.ids)}
                    for p in dict.fromkeys(p for b in (*w.singles, *w.groups) for p in b.prompts)
                ],
                "skipped_long": w.skipped_long,
            }
            for w in workloads
        },
        "summaries": [s.as_dict() for s in summarize(records)],
        "noise": round_noise(records),
        "lossless": lossless.as_dict(),
        "peer": {"status": "skipped", "reason": peer_reason}
        if peer is None
        else {**peer_section(records, peer.name), "info": peer_info or {}},
        "contracts": contract,
        "runs": [r.as_dict() for r in records],
    }
    report["targets"] = [t.as_dict() for t in evaluate_targets(report)]
    return report


def warm_up(
    workloads: Sequence[Workload], runners: Sequence[Runner], stop_token_ids: tuple[int, ...], options: BenchOptions
) -> None:
    """One short untimed run per runner and batch size: the first forward of a shape pays one-time costs."""
    spec = RunSpec(0.0, min(4, options.max_tokens), stop_token_ids, options.seed)
    for size in options.batch_sizes:
        first = next((w.batches(size)[0] for w in workloads if w.batches(size)), None)
        if first is None:
            continue
        for runner in runners:
            if runner.supports(first.size, spec):
                runner.run(first, spec, -1)


def contract_workload(workloads: Sequence[Workload]) -> Workload | None:
    """The contract modes run on HumanEval's batch-1 prompts when it is benched, else the first suite's."""
    with_singles = [w for w in workloads if w.singles]
    return next((w for w in with_singles if w.suite == HEADLINE_SUITE), with_singles[0] if with_singles else None)


def count_runs(workloads: Sequence[Workload], options: BenchOptions, with_peer: bool) -> int:
    """How many runs ``run_bench`` will make (for the progress bar)."""
    engines = 1 + len(options.backends)
    total = 0
    for w in workloads:
        for size in options.batch_sizes:
            for t in options.temperatures:
                per = engines + (1 if with_peer and size == 1 and t == 0.0 else 0)
                total += len(w.batches(size)) * options.repeats * per
    home = contract_workload(workloads)
    if options.modes_backend is not None and home is not None:
        total += min(options.contract_prompts, len(home.singles)) * max(2, options.repeats) * len(MODES)
    return total


# -- outputs -----------------------------------------------------------------------------------------------------


def write_outputs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``bench.json``, the PNG plots and ``bench.md`` (which links the plots) into ``out_dir``."""
    from specdec.bench_plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        report["plots"] = write_plots(report, out_dir)
    except ImportError as exc:  # matplotlib is the bench extra's; the tables do not need it
        report["plots"] = []
        report["plots_skipped"] = str(exc)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out_dir / "bench.md").write_text(render_markdown(report), encoding="utf-8")
    return [out_dir / "bench.json", out_dir / "bench.md", *(out_dir / p for p in report["plots"])]


def write_docs(report: dict[str, Any], out_dir: Path, doc: Path) -> None:
    """Replace the generated section of ``doc`` with this report and copy the plots beside it."""
    text = doc.read_text(encoding="utf-8")
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{doc} has no generated section ({DOCS_BEGIN!r} ... {DOCS_END!r})")
    images = doc.parent / "benchmarks"
    images.mkdir(exist_ok=True)
    for plot in report.get("plots", []):
        shutil.copyfile(out_dir / plot, images / plot)
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    body = render_markdown(report, image_dir="benchmarks")
    doc.write_text(f"{head}{DOCS_BEGIN}\n\n{body}\n{DOCS_END}{tail}", encoding="utf-8")


# -- the command line --------------------------------------------------------------------------------------------


def _csv(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target, from `specdec models list` (must be pulled)")
    p.add_argument("--suites", default=",".join(SUITES), help="comma-separated prompt suites (default all)")
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help="comma-separated backends to compare with plain decoding ('none': plain only)",
    )
    p.add_argument("--num-spec-tokens", "-k", type=int, default=4, help="draft tokens per step, every backend")
    p.add_argument("--max-tokens", type=int, help="new tokens per prompt at most (default 64; --quick 8)")
    p.add_argument("--singles", type=int, help="prompts per suite run alone, batch 1 (default 4; --quick 1)")
    p.add_argument("--group-size", type=int, help="the larger batch size (default 8; --quick 2)")
    p.add_argument("--groups", type=int, help="batches of --group-size per suite (default 1)")
    p.add_argument("--batch-sizes", help="comma-separated: 1 and/or the group size (default both)")
    p.add_argument("--temperatures", help="comma-separated sampling temperatures (default 0,1; 0 is greedy)")
    p.add_argument("--repeats", type=int, help="interleaved rounds per batch (default 2; --quick 1)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped, not cut")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's dtype")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bf16: a request's logits do not depend on its batch (slower; Transformer.batch_invariant)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--weights",
        choices=["auto", "trained", "random"],
        default="auto",
        help="drafter weights: the shipped trained ones (auto: if shipped, else random with a warning)",
    )
    p.add_argument("--contracts", choices=["off", "shapes", "full"], default="off", help="contract mode for timing")
    p.add_argument("--contract-backend", help="backend whose runs time the contract modes (default dspark)")
    p.add_argument("--contract-prompts", type=int, help="HumanEval prompts for the contract modes (default 2)")
    p.add_argument(
        "--peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time transformers generate (batch 1, greedy) in a subprocess",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, every code path once (figures meaningless)")
    p.add_argument("--out", default="bench-results", help="output folder: bench.json, bench.md, *.png")
    p.add_argument(
        "--write-docs",
        nargs="?",
        const=DOCS_PATH,
        metavar="PATH",
        help=f"also refresh the generated section of {DOCS_PATH} (or PATH) and copy the plots beside it",
    )


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    base = replace(BenchOptions(), **QUICK) if args.quick else BenchOptions()
    given: dict[str, Any] = {
        "model": args.model,
        "suites": _csv(args.suites),
        "backends": () if args.backends.strip() == "none" else _csv(args.backends),
        "k": args.num_spec_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "dtype": args.dtype,
        "batch_invariant": args.batch_invariant,
        "threads": args.threads,
        "weights": args.weights,
        "contracts": args.contracts,
        "contract_backend": args.contract_backend,
        "peer": args.peer,
        "seed": args.seed,
    }
    for name in ("max_tokens", "singles", "group_size", "groups", "repeats", "contract_prompts"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    try:
        if args.batch_sizes is not None:
            given["batch_sizes"] = tuple(int(v) for v in _csv(args.batch_sizes))
        elif "group_size" in given:
            given["batch_sizes"] = (1, given["group_size"])
        if args.temperatures is not None:
            given["temperatures"] = tuple(float(v) for v in _csv(args.temperatures))
    except ValueError as exc:
        raise ValueError(f"--batch-sizes and --temperatures take comma-separated numbers: {exc}") from None
    return replace(base, **given)  # values checked by BenchOptions.__post_init__


def run(args: argparse.Namespace) -> int:
    """Load the model and the suites, start the peer, run, write; 0 on success, 1/2 on missing model / bad input."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specdec.bench_peer import PeerUnavailable, TransformersPeer
    from specdec.models import ModelStore, ModelStoreError, UnknownModelError, load

    console = Console(stderr=True)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"specdec bench: {exc}", file=sys.stderr)
        return 2
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    peer: TransformersPeer | None = None
    peer_reason = "disabled (--no-peer)"
    try:
        if options.peer and 1 in options.batch_sizes and 0.0 in options.temperatures:
            # Started first: it loads the GGUF (~30 s) while the target loads and the suites are tokenized.
            gguf = ModelStore().source_gguf(options.model)
            peer = TransformersPeer(gguf, dtype=options.dtype, threads=torch.get_num_threads())
        elif options.peer:
            peer_reason = "the peer runs batch 1 greedy only, and this run has none"
        target, tokenizer = load(options.model, dtype=options.torch_dtype, download=False)
        target.batch_invariant = options.batch_invariant
    except (ModelStoreError, UnknownModelError) as exc:
        print(f"specdec bench: {exc} (pull it first: specdec models pull {options.model})", file=sys.stderr)
        if peer is not None:
            peer.close()
        return 1
    try:
        workloads = [
            build_workload(
                suite,
                tokenizer,
                singles=options.singles if 1 in options.batch_sizes else 0,
                group_size=options.group_size,
                groups=options.groups if options.group_size in options.batch_sizes else 0,
                max_prompt_tokens=options.max_prompt_tokens,
            )
            for suite in options.suites
        ]
        peer_info: dict[str, Any] | None = None
        if peer is not None:
            with console.status("waiting for transformers to load the GGUF (the peer)"):
                try:
                    peer_info = peer.wait_ready()
                    console.print(f"transformers peer ready ({peer_info['load_s']:.0f} s to load)")
                except PeerUnavailable as exc:
                    peer_reason = str(exc)
                    console.print(f"[yellow]transformers peer skipped: {exc}[/]")
                    peer.close()
                    peer = None
        stop = tuple(tokenizer.stop_token_ids)
        console.print(f"[bold]{options.command()}[/]")
        columns = (
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("warming up (untimed)", total=count_runs(workloads, options, peer is not None))

            def advance(record: RunRecord) -> None:
                label = f"{record.batch_key} T={record.temperature:g} {record.runner}"
                progress.update(task, advance=1, description=f"{label} {record.tokens_per_s:6.1f} tok/s")

            report = run_bench(
                target,
                workloads,
                stop,
                options,
                peer=peer,
                peer_info=peer_info,
                peer_reason=peer_reason,
                on_run=advance,
            )
    except (ValueError, FileNotFoundError, ModelStoreError) as exc:  # bad options, missing weights or corpora
        print(f"specdec bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if peer is not None:
            peer.close()
    out_dir = Path(args.out)
    written = write_outputs(report, out_dir)
    if args.write_docs is not None:
        write_docs(report, out_dir, Path(args.write_docs))
        written.append(Path(args.write_docs))
    sys.stdout.write(render_markdown(report))
    for name, drafter in report["drafters"].items():
        if drafter["note"]:
            console.print(f"[yellow]{name}: {drafter['note']}[/]")
    if "plots_skipped" in report:
        console.print(f"[yellow]no plots: {report['plots_skipped']}[/]")
    console.print("wrote " + ", ".join(map(str, written)))
    return 0
