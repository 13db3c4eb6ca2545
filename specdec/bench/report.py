"""The bench's figures: per suite, batch size, temperature and runner, then the targets and a markdown rendering.

Everything here works on plain data (``RunRecord`` lists in, JSON-ready
dicts out), and ``render_markdown`` reads only the JSON report, so a saved
``bench.json`` renders again without rerunning anything.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from specdec.bench.lossless import is_tie
from specdec.bench.runner import PLAIN, RunRecord, pair_ratios
from specdec.draft_decisions import KINDS, count_decisions
from specdec.metrics import SpeculationCounters
from specdec.nn.packed_linear import fp32_kernel_choice

HEADLINE_SUITE = "humaneval"


@dataclass(frozen=True)
class Spread:
    """The median of per-round ratios, with their range and count."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class Summary:
    """One runner on one suite at one batch size and temperature, over all its batches and rounds."""

    suite: str
    batch_size: int
    temperature: float
    runner: str
    runs: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    tau: float | None
    """Output tokens per verify step (``None`` for plain decoding and the peer, which do not verify drafts)."""
    acceptance_by_position: list[float]
    speedup: Spread | None
    """Tokens/s over plain decoding's in the same round; the median is the headline figure."""
    decisions: dict[str, int] | None = None
    """The adaptive policy's decisions over these runs, by kind (``draft_decisions.KINDS``); ``None`` without one."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Iterable[RunRecord], baseline: str = PLAIN) -> list[Summary]:
    """One ``Summary`` per (suite, batch size, temperature, runner), in first-seen order."""
    groups: dict[tuple[str, int, float, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.suite, r.batch_size, r.temperature, r.runner), []).append(r)
    by_config: dict[tuple[str, int, float], list[RunRecord]] = {}
    for (suite, size, temp, _), rs in groups.items():
        by_config.setdefault((suite, size, temp), []).extend(rs)
    ratios = {config: pair_ratios(rs, baseline) for config, rs in by_config.items()}
    out = []
    for (suite, size, temp, runner), rs in groups.items():
        tokens = sum(r.tokens for r in rs)
        wall = sum(r.wall_s for r in rs)
        speculation = SpeculationCounters()
        for r in rs:
            speculation.add(r.speculation)
        trace = "".join(r.decisions for r in rs)
        out.append(
            Summary(
                suite=suite,
                batch_size=size,
                temperature=temp,
                runner=runner,
                runs=len(rs),
                tokens=tokens,
                wall_s=wall,
                tokens_per_s=tokens / wall if wall > 0 else 0.0,
                tau=speculation.acceptance_length if speculation.verify_steps else None,
                acceptance_by_position=speculation.acceptance_rate_by_position,
                speedup=Spread.of(ratios[(suite, size, temp)].get(runner, [])),
                decisions=count_decisions(trace) if trace else None,
            )
        )
    return out


def round_noise(records: Iterable[RunRecord], runner: str = PLAIN) -> float | None:
    """How much ``runner``'s tokens/s moved between rounds of the same batch: the median of max/min - 1.

    A yardstick for the speedups: on a quiet machine it is a few percent; a
    shared one can reach tens of percent, and a ratio within that is noise.
    """
    rates: dict[tuple[str, float], list[float]] = {}
    for r in records:
        if r.runner == runner and r.tokens_per_s > 0:
            rates.setdefault((r.batch_key, r.temperature), []).append(r.tokens_per_s)
    spreads = [max(v) / min(v) - 1.0 for v in rates.values() if len(v) >= 2]
    return statistics.median(spreads) if spreads else None


@dataclass(frozen=True)
class Target:
    """One of the issue's targets, measured: the value, whether it holds, and what was compared."""

    name: str
    passed: bool | None
    """``None`` when it could not be measured in this run (a backend or the peer missing)."""
    value: str
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _headline(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        s["runner"]: s
        for s in summaries
        if s["suite"] == HEADLINE_SUITE and s["batch_size"] == 1 and s["temperature"] == 0.0
    }


HEADLINE = "batch 1, greedy, HumanEval"


def _speed_targets(head: dict[str, dict[str, Any]], backends: Sequence[str]) -> list[Target]:
    name = f"best backend >= 2.0x plain ({HEADLINE})"
    speed = {b: head[b]["speedup"]["median"] for b in backends if b in head and head[b].get("speedup")}
    if not speed:
        return [Target(name, None, "no backend ran on the headline configuration")]
    best = max(speed, key=lambda b: speed[b])
    return [
        Target(name, speed[best] >= 2.0, f"{best} {speed[best]:.2f}x"),
        Target(
            f"every backend >= 1.3x plain ({HEADLINE})",
            all(s >= 1.3 for s in speed.values()),
            ", ".join(f"{b} {s:.2f}x" for b, s in speed.items()),
        ),
    ]


def _cell(s: dict[str, Any]) -> str:
    return f"{s['suite']} b{s['batch_size']} T={s['temperature']:g}"


def every_cell_target(summaries: Sequence[dict[str, Any]], backends: Sequence[str], noise: float | None) -> Target:
    """Every backend at least as fast as plain decoding in every cell; a shortfall within the round noise is allowed.

    A cell's figure is its median of per-round ratios; the yardstick is the
    run's own noise (plain decoding's spread between rounds), so a cell below
    ``1 - noise`` is a systematic slowdown, not a noisy 1.0x. Without a noise
    figure (one round) nothing is allowed.
    """
    name = "every backend >= 1.0x plain in every cell (within the noise)"
    cells = [s for s in summaries if s["runner"] in backends and s.get("speedup")]
    if not cells:
        return Target(name, None, "no backend ran")
    floor = 1.0 - (noise or 0.0)
    below = [s for s in cells if s["speedup"]["median"] < 1.0]
    beyond = [s for s in below if s["speedup"]["median"] < floor]
    low = min(cells, key=lambda s: s["speedup"]["median"])
    allowed = "no noise figure" if noise is None else f"the noise {noise:.1%}"
    value = (
        f"{len(below)} of {len(cells)} cells below 1.0x, {len(beyond)} beyond {allowed}; "
        f"lowest {_cell(low)} {low['runner']} {low['speedup']['median']:.3f}x"
    )
    by_cell: dict[str, list[str]] = {}
    for s in beyond:
        by_cell.setdefault(_cell(s), []).append(f"{s['runner']} {s['speedup']['median']:.3f}x")
    note = "; ".join(f"{cell}: {', '.join(runs)}" for cell, runs in by_cell.items())
    return Target(name, not beyond, value, f"beyond the noise: {note}" if note else "")


def lossless_target(lossless: dict[str, Any]) -> Target:
    """Greedy output token for token plain decoding's, every backend and batch; a mismatch passes only as a tie."""
    name = "greedy output equals plain decoding (ties explained)"
    if not lossless:
        return Target(name, None, "not compared")
    compared = sum(lossless["compared"].values())
    identical = sum(lossless["identical"].values())
    batching = lossless["batching"]
    mismatches = lossless["mismatches"] + lossless["batching_mismatches"]
    not_ties = [m for m in mismatches if not is_tie(m["verdict"])]
    value = (
        f"{identical}/{compared} identical to plain, plain alone vs batched "
        f"{batching['identical']}/{batching['compared']}; {len(mismatches)} mismatch(es), {len(not_ties)} not a tie"
    )
    return Target(name, not not_ties, value, "sampling: the chi-square tests of the test suite")


def _peer_target(peer: dict[str, Any]) -> Target:
    name = "engine plain >= 1.3x transformers generate"
    ratio = peer.get("engine_over_transformers")
    if not ratio:
        return Target(name, None, peer.get("reason", "peer not run"))
    lookup = peer.get("prompt_lookup")
    note = (
        ""
        if lookup is None
        else f"transformers' prompt lookup: {lookup['speedup_over_transformers']['median']:.2f}x its own generate"
    )
    return Target(
        name, ratio["median"] >= 1.3, f"{ratio['median']:.2f}x (tokens/s ratio, median of {ratio['n']})", note
    )


def _tau_target(head: dict[str, dict[str, Any]], k: int) -> list[Target]:
    order = [b for b in ("dspark", "dflash", "eagle") if b in head and head[b].get("tau") is not None]
    if len(order) < 2:
        return []
    taus = [head[b]["tau"] for b in order]
    return [
        Target(
            " > ".join(f"{b} tau" for b in order) + f" ({HEADLINE})",
            all(a > b for a, b in itertools.pairwise(taus)),
            ", ".join(f"{b} {t:.2f}" for b, t in zip(order, taus, strict=True)),
            f"equal K = {k}",
        )
    ]


def _contract_targets(modes: dict[str, Any]) -> list[Target]:
    targets: list[Target] = []
    fraction = modes.get("shapes", {}).get("check_fraction")
    rel = modes.get("shapes", {}).get("time_vs_off")
    if fraction is not None:
        wall = f"; wall {rel['median']:.3f}x off" if rel else ""
        targets.append(Target("shapes contracts < 2% of step time", fraction < 0.02, f"{fraction:.2%} in checks{wall}"))
    none = modes.get("none", {}).get("time_vs_off")
    if none:
        # Indistinguishable: the ratio's range over the rounds straddles 1 or lies within 2% of it.
        straddles = none["low"] <= 1.0 <= none["high"] or abs(none["median"] - 1.0) < 0.02
        targets.append(
            Target(
                "off indistinguishable from no contracts",
                straddles,
                f"no-contracts time {none['median']:.3f}x off (range {none['low']:.3f}-{none['high']:.3f}, "
                f"{none['n']} rounds)",
            )
        )
    return targets


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    """The speed, losslessness and peer targets, then the drafters' tau order and the contracts' cost."""
    summaries = report.get("summaries", [])
    head = _headline(summaries)
    backends = list(report["config"]["backends"])
    return [
        *_speed_targets(head, backends),
        every_cell_target(summaries, backends, report.get("noise")),
        lossless_target(report.get("lossless", {})),
        _peer_target(report.get("peer", {})),
        *_tau_target(head, report["config"]["k"]),
        *_contract_targets(report.get("contracts", {}).get("modes", {})),
    ]


# -- markdown --------------------------------------------------------------------------------------------------


def _noise_line(noise: float | None) -> str:
    if noise is None:
        return "Noise: not measured (one round per batch)."
    return (
        f"Noise: plain decoding's tokens/s on the same batch moved by a median {noise:.1%} between rounds "
        "(speedups within that are not significant)."
    )


def _fmt_speedup(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"**{s['median']:.2f}x** ({s['low']:.2f}-{s['high']:.2f}, n={s['n']})"


def _fmt_positions(rates: Sequence[float]) -> str:
    return " ".join(f"{r:.2f}" for r in rates) if rates else "-"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _cpu_phrase(env: dict[str, Any]) -> str:
    """The CPU by name where the report recorded it (reports from before did not)."""
    cores = f"{env['cpu_count']} CPU core(s)"
    return f"{cores} ({env['cpu']})" if env.get("cpu") else cores


def _fp32_kernel_phrase(env: dict[str, Any]) -> str:
    """Which kernel float32 products of a few rows ran on (``specdec.nn.fp32_kernels``): it moves every figure."""
    if env.get("dtype") != "float32" or "fp32_f_linear_rows" not in env:
        return ""
    return f" ({fp32_kernel_choice(env['fp32_f_linear_rows'], onednn=env.get('onednn', True))})"


def _k_phrase(cfg: dict[str, Any]) -> str:
    """K, and the longer K of a prompt-lookup match where ``-O lookup_drafts`` raised it past the drafters'."""
    k = cfg["k"]
    longer = [int(v) for name, v in cfg.get("backend_options") or [] if name == "lookup_drafts" and int(v) > k]
    return f"K = {k}" + (f" for the drafters, up to {max(longer)} for a prompt-lookup match" if longer else "")


def _decision_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the adaptive policy chose in each cell: the kinds of its decisions (one per step that could draft)."""
    adaptive = [s for s in rows if s.get("decisions")]
    if not adaptive:
        return []
    return [
        "",
        "Adaptive draft-length decisions (one per step in which a request could draft): `proposed` drafted from "
        "the drafter, `free` only a prompt lookup's drafts, `probe` only probes, `none` nothing, `baseline` nothing "
        "to re-measure plain decoding's step, `calibrating` the first steps' fixed lengths.",
        "",
        *_table(
            ["batch", "T", "runner", *KINDS],
            (
                [str(s["batch_size"]), f"{s['temperature']:g}", s["runner"], *(str(s["decisions"][k]) for k in KINDS)]
                for s in adaptive
            ),
        ),
    ]


def render_markdown(report: dict[str, Any], *, image_dir: str = ".") -> str:
    """The report as markdown: targets, per-suite tables, losslessness, the peer, contract modes, plots."""
    cfg = report["config"]
    env = report["environment"]
    lines = [
        f"Command: `{report['command']}`",
        "",
        *(["**Interrupted**: partial results from the runs that finished.", ""] if report.get("interrupted") else []),
        f"Run {report['created_utc']} on {env['platform']}, {_cpu_phrase(env)}, torch {env['torch']}, "
        f"{env['threads']} thread(s); target `{env['model']}` in {env['dtype']}{_fp32_kernel_phrase(env)}; "
        f"contracts `{env['contracts']}` during timing; {_k_phrase(cfg)}; at most {cfg['max_tokens']} new tokens "
        "(greedy runs stop as "
        "`specdec generate`; sampled ones decode all of them, the same work for every runner); "
        f"{cfg['repeats']} interleaved round(s) per batch; host allocator: {env.get('allocator', 'not recorded')}.",
        "",
        _noise_line(report.get("noise")),
        "",
        "Drafter weights: "
        + ", ".join(f"{b} `{d.get('weights_source', '?')}`" for b, d in report.get("drafters", {}).items())
        + ".",
        "",
        "### Targets",
        "",
    ]
    marks = {True: "yes", False: "**no**", None: "n/a"}
    lines += _table(
        ["target", "holds", "measured", "note"],
        ([t["name"], marks[t["passed"]], t["value"], t.get("note", "")] for t in report.get("targets", [])),
    )
    for suite in cfg["suites"]:
        rows = [s for s in report["summaries"] if s["suite"] == suite]
        if not rows:
            continue
        work = report.get("workloads", {}).get(suite, {})
        lines += ["", f"### {suite}", ""]
        if work:
            lens = [p["tokens"] for p in work.get("prompts", [])]
            if lens:
                lines += [f"{len(lens)} prompts, {min(lens)}-{max(lens)} tokens.", ""]
        lines += _table(
            ["batch", "T", "runner", "tau", "acceptance by position", "tokens/s", "speedup vs plain", "tokens"],
            (
                [
                    str(s["batch_size"]),
                    f"{s['temperature']:g}",
                    s["runner"],
                    "-" if s["tau"] is None else f"{s['tau']:.2f}",
                    _fmt_positions(s["acceptance_by_position"]),
                    f"{s['tokens_per_s']:.1f}",
                    _fmt_speedup(s["speedup"]) if s["runner"] != PLAIN else "1 (baseline)",
                    str(s["tokens"]),
                ]
                for s in rows
            ),
        )
        lines += _decision_table(rows)
    lines += ["", "### Losslessness (greedy)", ""]
    lossless = report.get("lossless", {})
    if lossless:
        compared, identical = lossless["compared"], lossless["identical"]
        lines += _table(
            ["runner", "outputs compared with plain", "identical"],
            ([name, str(n), str(identical.get(name, 0))] for name, n in compared.items()),
        )
        batching = lossless["batching"]
        lines += [
            "",
            f"Plain greedy alone vs in a batch: {batching['identical']}/{batching['compared']} outputs identical.",
        ]
        mismatches = lossless["mismatches"] + lossless["batching_mismatches"]
        if mismatches:
            lines += [""]
            lines += _table(
                ["runner", "vs", "prompt", "round", "first differing position", "plain top-1/top-2 gap", "verdict"],
                (
                    [
                        m["runner"],
                        m["reference"],
                        m["prompt"],
                        str(m["repeat"]),
                        f"{m['position']} ({m['expected']} vs {m['got']})",
                        "-" if m["gap"] is None else f"{m['gap']:.5f}",
                        m["verdict"],
                    ]
                    for m in mismatches
                ),
            )
        else:
            lines += ["", "No mismatches."]
    lines += ["", "### transformers `generate` (plain greedy, batch 1, same prompts)", ""]
    peer = report.get("peer", {})
    if peer.get("status") == "ok":
        info = peer.get("info", {})
        ratio = peer["engine_over_transformers"]
        lines += [
            f"transformers {info.get('transformers', '?')} in a subprocess, {info.get('dtype', '?')}, "
            f"{info.get('threads', '?')} thread(s), loaded from the source GGUF in {info.get('load_s', 0):.0f} s; "
            f"host allocator as the engine's: {info.get('allocator', 'not recorded')}.",
            "",
        ]
        lines += _table(
            ["suite", "engine plain tokens/s", "transformers tokens/s", "engine / transformers", "same tokens"],
            (
                [
                    row["suite"],
                    f"{row['engine_tokens_per_s']:.1f}",
                    f"{row['transformers_tokens_per_s']:.1f}",
                    _fmt_speedup(row["engine_over_transformers"]),
                    f"{row['same_tokens']}/{row['compared']}",
                ]
                for row in peer.get("suites", [])
            ),
        )
        lines += ["", f"Over all suites: engine / transformers {_fmt_speedup(ratio)}."]
        lookup = peer.get("prompt_lookup")
        if lookup is not None:
            lines += [
                "",
                f"transformers' own speculative decoding on the same prompts, prompt lookup "
                f"(`generate(..., prompt_lookup_num_tokens={info.get('prompt_lookup_num_tokens', '?')})`): "
                f"{lookup['tokens_per_s']:.1f} tokens/s, {_fmt_speedup(lookup['speedup_over_transformers'])} its own "
                f"plain `generate` (same tokens in {lookup['same_tokens']}/{lookup['compared']} runs); compare the "
                "backends' speedups over the engine's plain decoding above.",
            ]
    else:
        lines += [f"Skipped: {peer.get('reason', 'not requested')}."]
    lines += ["", "### Contract modes", ""]
    cons = report.get("contracts", {})
    if cons.get("status") == "ok":
        lines += [
            f"Backend `{cons['backend']}` on {cons['prompts']} {cons['suite']} prompt(s), batch 1, greedy, "
            f"{cons['repeats']} interleaved round(s) per prompt. Time relative to `off` is a median of per-round "
            "ratios; 'in checks' is the share of wall time inside the contract entry points.",
            "",
        ]
        lines += _table(
            ["mode", "time vs off", "tokens/s", "in checks"],
            (
                [
                    mode,
                    "1 (baseline)" if mode == "off" else _fmt_speedup(m.get("time_vs_off")).replace("**", ""),
                    f"{m['tokens_per_s']:.1f}",
                    "-" if m.get("check_fraction") is None else f"{m['check_fraction']:.2%}",
                ]
                for mode, m in cons["modes"].items()
            ),
        )
    else:
        lines += [f"Skipped: {cons.get('reason', 'not requested')}."]
    plots = report.get("plots", [])
    if plots:
        lines += ["", "### Plots", ""]
        lines += [f"![{p}]({image_dir}/{p})" for p in plots]
    return "\n".join(lines) + "\n"
