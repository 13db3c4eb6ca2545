"""``specdec bench``'s options: what shapes a run, its command line, and the command that reproduces it."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdec.bench.output import DOCS_PATH
from specdec.bench.runner import PLAIN
from specdec.bench.suites import SUITES
from specdec.cli.argtypes import LIST_HELP, add_backends_option, list_of
from specdec.cli.backend_options import OptionValue, add_backend_option, collect

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_BACKENDS = ("eagle", "dflash", "dspark")


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
    verify_attention: str = "exact"
    """``exact``: each bf16 verify row attends as its decode would; ``batched``: one masked call over the exact
    width (``Transformer.exact_verify`` off)."""
    threads: int | None = None
    weights: str = "auto"
    contracts: str = "off"
    contract_backend: str | None = None
    contract_prompts: int = 2
    peer: bool = True
    draft_length: str = "adaptive"
    """The backends' draft length per step: ``adaptive`` (the engine's cost-model policy) or ``fixed`` (always K)."""
    prompt_lookup: int = 10
    """transformers' own speculative peer: ``generate(prompt_lookup_num_tokens=N)`` beside its plain generate; 0: off."""
    seed: int = 0
    backend_options: tuple[tuple[str, OptionValue], ...] = ()
    """``-O KEY=VALUE``: each goes to every compared backend whose factory takes KEY."""

    def options_for(self, backend: str) -> dict[str, OptionValue]:
        """The ``-O`` options ``backend``'s factory takes."""
        from specdec.backend_registry import factory_for
        from specdec.llm import factory_options

        takes = set(factory_options(factory_for(backend)))
        return {key: value for key, value in self.backend_options if key in takes}

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
            "prompt_lookup": self.prompt_lookup >= 0,
            "draft_length": self.draft_length in ("fixed", "adaptive"),
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
        args += ["--draft-length", self.draft_length]
        if self.contract_backend is not None:
            args += ["--contract-backend", self.contract_backend]
        for key, value in self.backend_options:
            args += ["-O", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
        if not self.peer:
            args.append("--no-peer")
        elif self.prompt_lookup != BenchOptions.prompt_lookup:
            args += ["--prompt-lookup", str(self.prompt_lookup)]
        if self.batch_invariant:
            args.append("--batch-invariant")
        if self.verify_attention != BenchOptions.verify_attention:
            args += ["--verify-attention", self.verify_attention]
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


# -- the command line --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target, from `specdec models list` (must be pulled)")
    p.add_argument(
        "--suites",
        action="extend",
        type=list_of(),
        help=f"prompt suites {LIST_HELP} (default: all: {', '.join(SUITES)})",
    )
    add_backends_option(
        p,
        f"backends to compare with plain decoding {LIST_HELP}; 'none': plain only "
        f"(default: {','.join(DEFAULT_BACKENDS)})",
    )
    p.add_argument("--num-spec-tokens", "-k", type=int, default=4, help="draft tokens per step, every backend")
    add_backend_option(
        p,
        "an option for every compared backend whose factory takes KEY, e.g. -O capacity=threshold for dspark "
        "(repeatable); a KEY none of them takes is refused",
    )
    p.add_argument("--max-tokens", type=int, help="new tokens per prompt at most (default 64; --quick 8)")
    p.add_argument("--singles", type=int, help="prompts per suite run alone, batch 1 (default 4; --quick 1)")
    p.add_argument("--group-size", type=int, help="the larger batch size (default 8; --quick 2)")
    p.add_argument("--groups", type=int, help="batches of --group-size per suite (default 1)")
    p.add_argument(
        "--batch-sizes", action="extend", type=list_of(), help=f"1 and/or the group size {LIST_HELP} (default both)"
    )
    p.add_argument(
        "--temperatures",
        action="extend",
        type=list_of(),
        help=f"sampling temperatures {LIST_HELP} (default 0,1; 0 is greedy)",
    )
    p.add_argument("--repeats", type=int, help="interleaved rounds per batch (default 2; --quick 1)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped, not cut")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's dtype")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bf16: a request's logits do not depend on its batch (slower; Transformer.batch_invariant)",
    )
    add_verify_attention_option(p)
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
    p.add_argument(
        "--draft-length",
        choices=["adaptive", "fixed"],
        default=BenchOptions.draft_length,
        help="backends draft an adaptive length per request and step (the engine's cost model; 0 = plain) or "
        f"always K (default: {BenchOptions.draft_length})",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=BenchOptions.prompt_lookup,
        metavar="N",
        help="with the peer: also run transformers' own speculative decoding, generate(prompt_lookup_num_tokens=N), "
        f"and report its speedup over its plain generate; 0 turns it off (default: {BenchOptions.prompt_lookup})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, every code path once (figures meaningless)")
    p.add_argument("--out", default="bench-results", help="output folder: bench.json, bench.md, *.png")
    p.add_argument(
        "--render",
        metavar="DIR",
        help="run nothing: judge the targets of DIR/bench.json (a past run's --out) again and rewrite its bench.md "
        "and plots (with --write-docs, the docs too); takes no other option",
    )
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
        "suites": SUITES if args.suites is None else tuple(args.suites),
        "backends": _backends(args.backends),
        "k": args.num_spec_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "dtype": args.dtype,
        "batch_invariant": args.batch_invariant,
        "verify_attention": args.verify_attention,
        "threads": args.threads,
        "weights": args.weights,
        "contracts": args.contracts,
        "contract_backend": args.contract_backend,
        "peer": args.peer,
        "prompt_lookup": args.prompt_lookup,
        "draft_length": args.draft_length,
        "seed": args.seed,
        "backend_options": tuple(collect(args.backend_option).items()),
    }
    for name in ("max_tokens", "singles", "group_size", "groups", "repeats", "contract_prompts"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    try:
        if args.batch_sizes is not None:
            given["batch_sizes"] = tuple(int(v) for v in args.batch_sizes)
        elif "group_size" in given:
            given["batch_sizes"] = (1, given["group_size"])
        if args.temperatures is not None:
            given["temperatures"] = tuple(float(v) for v in args.temperatures)
    except ValueError as exc:
        raise ValueError(f"--batch-sizes and --temperatures take comma-separated numbers: {exc}") from None
    return replace(base, **given)  # values checked by BenchOptions.__post_init__


def _backends(given: list[str] | None) -> tuple[str, ...]:
    """``--backend`` as given (``none`` alone: plain decoding only), else the default three."""
    if given is None:
        return DEFAULT_BACKENDS
    if "none" in given:
        if given != ["none"]:
            raise ValueError(f"--backend none means plain decoding only; it cannot be listed with {given}")
        return ()
    return tuple(given)


VERIFY_ATTENTION = ("exact", "batched")


def configure_target(target: Any, *, batch_invariant: bool, verify_attention: str) -> None:
    """The target's numerics ``bench`` and ``bench-phases`` ask for: batch invariance, and whether bf16 verify rows
    attend one by one (``exact``) or in one call (``batched``)."""
    if verify_attention not in VERIFY_ATTENTION:
        raise ValueError(f"verify_attention must be one of {', '.join(VERIFY_ATTENTION)}, got {verify_attention!r}")
    target.batch_invariant = batch_invariant
    target.exact_verify = verify_attention == "exact"


def add_verify_attention_option(p: argparse.ArgumentParser) -> None:
    """``--verify-attention``, shared by ``bench`` and ``bench-phases``."""
    p.add_argument(
        "--verify-attention",
        choices=VERIFY_ATTENTION,
        default=BenchOptions.verify_attention,
        help="bf16 verify rows: exact (each attends as its decode does, equal to it bit for bit) or batched (one "
        "call of several query rows per request: slightly faster, but greedy output may part from plain decoding "
        "at near ties) "
        f"(default: {BenchOptions.verify_attention})",
    )
