"""``specdec bench``: plain decoding and every backend on fixed prompt suites, interleaved, in one process.

Per suite (HumanEval prompts, MT-Bench first turns, Shakespeare passages),
batch size (1 and 8) and temperature (greedy and 1), plain decoding and each
backend run the same prompts back to back, the order alternating between
rounds (``specdec.bench.runner``). Reported: tau, acceptance by draft
position, tokens/s and the speedup over plain decoding (median of the
per-round ratios); transformers ``generate`` on the same model as a peer of
plain decoding (``specdec.bench.peer``); greedy losslessness on every prompt
(``specdec.bench.lossless``); the cost of each contract mode
(``specdec.bench.contract_modes``). Writes ``bench.json``, ``bench.md`` and
two PNG plots; ``--write-docs`` refreshes ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import contracts
from specdec.backend_registry import create, names_option
from specdec.bench.contract_modes import MODES, ModeRunner
from specdec.bench.lossless import check_lossless, relative_tie_tolerance_for, tie_tolerance_for, top_two
from specdec.bench.options import BenchOptions, configure_target, options_from_args
from specdec.bench.output import check_docs, write_docs, write_outputs
from specdec.bench.report import HEADLINE_SUITE, Spread, evaluate_targets, render_markdown, round_noise, summarize
from specdec.bench.runner import PLAIN, EngineRunner, Runner, RunRecord, RunSpec, interleave, pair_ratios
from specdec.bench.suites import Workload, build_workload
from specdec.draft_length import CALIBRATION
from specdec.host_allocator import keep_freed_memory
from specdec.hub.kernel_choice import cpu_model
from specdec.nn.packed_linear import fp32_f_linear_rows, mkldnn_available
from specdec.nn.transformer import Transformer
from specdec.speculator import Speculator

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


def resolve_drafter(
    name: str, target: Transformer, *, k: int, weights: str, model: str, extra: dict[str, Any] | None = None
) -> Drafter:
    """Trained weights shipped for ``model`` when asked (``auto``: when there are any), else freshly seeded ones.

    The speculator's own ``weights_source`` attribute is reported when it has
    one; otherwise whether it owns parameters beyond the target's.
    """
    from specdec.cli.streaming import drafter_weights_are_random

    options: dict[str, Any] = {"num_spec_tokens": k, **(extra or {})}
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


def peer_section(records: Sequence[RunRecord], peer_name: str, lookup_name: str | None = None) -> dict[str, Any]:
    """Engine plain vs the transformers peer: tokens/s ratios per round, per suite and overall, and token agreement.

    With ``lookup_name``, transformers' own speculative decoding (prompt lookup)
    against its own plain ``generate`` in the same rounds, next to ours.
    """
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
    section: dict[str, Any] = {"status": "ok", "suites": suites, "engine_over_transformers": _spread_dict(overall)}
    lookup = [r for r in records if r.runner == lookup_name]
    if lookup and lookup_name is not None:
        theirs = [r for r in records if r.runner == peer_name]
        plain = {r.round_key: r for r in theirs}
        same = [plain[r.round_key].outputs == r.outputs for r in lookup if r.round_key in plain]
        section["prompt_lookup"] = {
            "runner": lookup_name,
            "tokens_per_s": _rate(lookup),
            "speedup_over_transformers": _spread_dict(pair_ratios(theirs + lookup, peer_name).get(lookup_name, [])),
            "same_tokens": sum(same),
            "compared": len(same),
        }
    return section


CONTRACT_ROUNDS = 6
"""Interleaved rounds of the contract modes at least: their runs do the same work in every mode, so what moves
between rounds is the host. With two rounds (the bench's default) one noisy run swung a mode by 6-8% either way
(``full`` measured 0.94x ``off`` once), and the verdict on ``off`` against no contracts flipped between runs."""


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
    repeats = max(CONTRACT_ROUNDS, options.repeats)
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
        "verify_attention": options.verify_attention,
        "model": options.model,
        "contracts": options.contracts,
        "allocator": keep_freed_memory(),  # what the CLI or run_bench set: every later call reports it
        "cpu": cpu_model(),
        "fp32_f_linear_rows": sorted(fp32_f_linear_rows()),  # the kernel choice float32 products ran under
        "onednn": mkldnn_available(),  # without it every float32 product ran on F.linear
    }


def run_bench(
    target: Transformer,
    workloads: Sequence[Workload],
    stop_token_ids: tuple[int, ...],
    options: BenchOptions,
    *,
    peer: Runner | None = None,
    peer_lookup: Runner | None = None,
    peer_info: dict[str, Any] | None = None,
    peer_reason: str = "disabled (--no-peer)",
    on_run: Callable[[RunRecord], None] = lambda _: None,
) -> dict[str, Any]:
    """The whole bench on an already loaded target; returns the JSON report (without plots)."""
    keep_freed_memory()  # before any run; recorded in the report's environment
    drafters = {
        name: resolve_drafter(
            name,
            target,
            k=options.k,
            weights=options.weights,
            model=options.model,
            extra=options.options_for(name),
        )
        for name in options.backends
    }
    runners: list[Runner] = [EngineRunner(PLAIN, target)]
    for drafter in drafters.values():
        runners.append(
            EngineRunner(
                drafter.name,
                target,
                lambda d=drafter: d.build(target),  # type: ignore[misc]
                draft_length=options.draft_length,
            )
        )
    peers = [r for r in (peer, peer_lookup) if r is not None]
    runners += peers
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
                        spec = RunSpec.equal_work(temperature, options.max_tokens, stop_token_ids, options.seed)
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
            skip=tuple(r.name for r in peers),
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
                if k not in ("model", "dtype", "batch_invariant", "verify_attention", "threads", "contracts")
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
        else {
            **peer_section(records, peer.name, None if peer_lookup is None else peer_lookup.name),
            "info": {**(peer_info or {}), "prompt_lookup_num_tokens": options.prompt_lookup if peer_lookup else 0},
        },
        "contracts": contract,
        "runs": [r.as_dict() for r in records],
    }
    report["targets"] = [t.as_dict() for t in evaluate_targets(report)]
    return report


WARM_UP_TOKENS = 2 * len(CALIBRATION) + 8
"""Tokens per warm-up run: the policy's calibration steps, then some chosen ones (a step emits at least one)."""


def warm_up(
    workloads: Sequence[Workload], runners: Sequence[Runner], stop_token_ids: tuple[int, ...], options: BenchOptions
) -> None:
    """Untimed runs before the timed ones, as a server's start-up: one per runner, batch size and temperature.

    The first forward of a shape pays one-time costs, and under the adaptive
    draft length each (batch size, temperature) has its own policy, whose first
    ``len(CALIBRATION)`` steps draft fixed lengths to fit the step cost. Each
    warm-up run decodes up to ``WARM_UP_TOKENS`` tokens, enough for those steps
    and a few chosen ones, so the timed runs see policies in their steady state.
    """
    spec_tokens = min(WARM_UP_TOKENS, options.max_tokens)
    for size in options.batch_sizes:
        first = next((w.batches(size)[0] for w in workloads if w.batches(size)), None)
        if first is None:
            continue
        for temperature in options.temperatures:
            spec = RunSpec.equal_work(temperature, spec_tokens, stop_token_ids, options.seed)
            for runner in runners:
                if runner.supports(first.size, spec):
                    runner.run(first, spec, -1)


def contract_workload(workloads: Sequence[Workload]) -> Workload | None:
    """The contract modes run on HumanEval's batch-1 prompts when it is benched, else the first suite's."""
    with_singles = [w for w in workloads if w.singles]
    return next((w for w in with_singles if w.suite == HEADLINE_SUITE), with_singles[0] if with_singles else None)


def count_runs(workloads: Sequence[Workload], options: BenchOptions, peers: int) -> int:
    """How many runs ``run_bench`` will make (for the progress bar)."""
    engines = 1 + len(options.backends)
    total = 0
    for w in workloads:
        for size in options.batch_sizes:
            for t in options.temperatures:
                per = engines + (peers if size == 1 and t == 0.0 else 0)
                total += len(w.batches(size)) * options.repeats * per
    home = contract_workload(workloads)
    if options.modes_backend is not None and home is not None:
        total += min(options.contract_prompts, len(home.singles)) * max(CONTRACT_ROUNDS, options.repeats) * len(MODES)
    return total


def check_backend_options(options: BenchOptions) -> None:
    """Each ``-O`` key is taken by at least one compared backend, and each backend accepts its values' keys."""
    from specdec.cli.backend_options import shared_among
    from specdec.cli.errors import UsageError

    if any(key == "pretrained" for key, _ in options.backend_options):
        raise UsageError("-O pretrained: bench chooses drafter weights with --weights auto|trained|random")
    shared_among(options.backend_options, options.backends, options.k)


def check_write_docs(args: argparse.Namespace) -> None:
    """``--write-docs``'s file holds the generated section: checked before anything is run or written."""
    from specdec.cli.errors import UsageError

    if args.write_docs is not None:
        try:
            check_docs(Path(args.write_docs))
        except ValueError as exc:
            raise UsageError(f"--write-docs: {exc}") from None


RENDER_TAKES = ("render", "write_docs")
"""The only options ``--render`` takes: what it reads, and where else it writes."""


def render_saved(args: argparse.Namespace) -> int:
    """``--render DIR``: a saved report's targets judged by today's rules, its markdown and plots written again."""
    import json

    from specdec.bench.options import add_arguments
    from specdec.cli.errors import UsageError

    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    given = [
        name
        for name, default in vars(defaults.parse_args([])).items()
        if name not in RENDER_TAKES and getattr(args, name, default) != default
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"--render runs nothing, so {flag} has nothing to change; it takes only --write-docs")
    out_dir = Path(args.render)
    saved = out_dir / "bench.json"
    try:
        report = json.loads(saved.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"--render {args.render}: no bench.json there; expected the --out folder of a bench run"
        ) from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--render {args.render}: bench.json is not JSON ({exc})") from None
    if not isinstance(report, dict) or not {"config", "summaries", "environment"} <= report.keys():
        raise UsageError(
            f"--render {args.render}: bench.json is not a bench report (no config, summaries, environment)"
        )
    check_write_docs(args)
    report["targets"] = [t.as_dict() for t in evaluate_targets(report)]
    written = write_outputs(report, out_dir)
    if args.write_docs is not None:
        write_docs(report, out_dir, Path(args.write_docs))
        written.append(Path(args.write_docs))
    sys.stdout.write(render_markdown(report))
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Load the model and the suites, start the peer, run, write; 0 on success, 1/2 on missing model / bad input."""
    if args.render is not None:
        return render_saved(args)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from specdec.bench.peer import PeerUnavailable, TransformersPeer
    from specdec.cli.errors import UsageError, check_backend, check_model
    from specdec.hub import ModelStore, ModelStoreError, UnknownModelError, load

    console = Console(stderr=True)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_write_docs(args)  # before the run, which may take an hour
    check_model(options.model)
    for backend in options.backends:
        check_backend(backend)
    check_backend_options(options)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    peer: TransformersPeer | None = None
    peer_reason = "disabled (--no-peer)"
    try:
        # The target first, alone: a first float32 load times its kernels (specdec.nn.fp32_kernels), and the peer's
        # loading beside it would make that timing a busy host's, not used (the peer loads while suites tokenize).
        target, tokenizer = load(options.model, dtype=options.torch_dtype, download=False)
        configure_target(target, batch_invariant=options.batch_invariant, verify_attention=options.verify_attention)
        if options.peer and 1 in options.batch_sizes and 0.0 in options.temperatures:
            gguf = ModelStore().source_gguf(options.model)
            peer = TransformersPeer(gguf, dtype=options.dtype, threads=torch.get_num_threads())
        elif options.peer:
            peer_reason = "the peer runs batch 1 greedy only, and this run has none"
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
            lookup = peer.prompt_lookup(options.prompt_lookup) if peer is not None and options.prompt_lookup else None
            peers = sum(r is not None for r in (peer, lookup))
            task = progress.add_task("warming up (untimed)", total=count_runs(workloads, options, peers))

            def advance(record: RunRecord) -> None:
                label = f"{record.batch_key} T={record.temperature:g} {record.runner}"
                progress.update(task, advance=1, description=f"{label} {record.tokens_per_s:6.1f} tok/s")

            report = run_bench(
                target,
                workloads,
                stop,
                options,
                peer=peer,
                peer_lookup=lookup,
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
