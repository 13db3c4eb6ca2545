"""Every subcommand answers a user's mistake with one line, ``specdec: error: ...``, and exit status 2.

Each case is a mistake a user made (or could make) and once got a traceback
for, or a silently ignored flag. The test runs ``main`` in-process: an
exception escaping it would be the traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdec.cli.errors import CONTRACT_MODES
from specdec.cli.main import all_commands, main

BAD_INPUT: dict[str, list[tuple[list[str], str]]] = {
    "": [([], "required: COMMAND"), (["nosuch"], "invalid choice: 'nosuch'")],
    "contracts": [
        (["contracts", "--format", "yaml"], "invalid choice: 'yaml'"),
        (["contracts", "--write", "no/such/folder/contracts.md"], "the folder no/such/folder does not exist"),
        (["contracts", "--check", "no-such-file.md"], "no such file"),
    ],
    "generate": [
        (["generate", "--backend", "nosuch"], "unknown backend 'nosuch'"),
        (["generate", "--backend", "no.such.module:factory"], "cannot import module 'no.such.module'"),
        (["generate", "hello"], "without --model the prompt is token ids"),
        (["generate", ""], "the prompt is empty"),
        (["generate", "-k", "0"], "-k: 0 is out of range; expected an integer >= 1"),
        (["generate", "--threads", "-1"], "--threads: -1 is out of range"),
        (["generate", "--seed", "1e23"], "--seed: '1e23' is not an integer"),
        (["generate", "--seed", str(2**64)], "--seed: 18446744073709551616 is out of range"),
        (["generate", "--num-requests", "0"], "--num-requests: 0 is out of range"),
        (["generate", "--max-tokens", "0"], "--max-tokens: 0 is out of range"),
        (["generate", "--temperature", "-1"], "--temperature: -1 is out of range"),
        (["generate", "--temperature", "nan"], "--temperature: nan is out of range"),
        (["generate", "--temperature", "1e-50"], "below 1.1754943508222875e-38"),
        (["generate", "--temperature", "1", "--top-p", "0"], "--top-p: 0 is out of range"),
        (["generate", "--top-k", "5"], "with --temperature 0 (greedy) they would be ignored"),
        (["generate", "--backend", "eagle", "--draft-is-target"], "--draft-is-target needs a backend that takes"),
        (["generate", "--backend", "dflash", "--fused"], "--fused needs a backend with a fused decode"),
        (["generate", "--backend", "plain", "-k", "3"], "-k needs a speculative backend"),
        (
            ["generate", "--backend", "plain", "--draft-length", "adaptive"],
            "--draft-length needs a speculative backend",
        ),
        (["generate", "--draft-length", "sometimes"], "--draft-length: invalid choice: 'sometimes'"),
        (["generate", "--dtype", "bfloat16"], "--dtype needs --model"),
        (["generate", "--no-chat"], "--chat/--no-chat needs --model"),
        (["generate", "--hidden", "30"], "a multiple of 4 is expected"),
        (["generate", "--model", "nosuch"], "unknown model 'nosuch'"),
        (["generate", "--model", "./no-such.gguf"], "no such file or directory"),
        (["generate", "--model", "smollm2-135m-instruct", "--layers", "2"], "--layers applies to the random tiny"),
        (["generate", "--model", "smollm2-135m-instruct", "bad \udcff bytes"], "the prompt is not valid UTF-8"),
        (["generate", "-b", "eagle,dflash"], "generate runs one backend, got eagle, dflash"),
        (["generate", "-b", "eagle", "--backend", "nosuch"], "generate runs one backend"),
        (["generate", "--stop", "x"], "--stop needs --model"),
        (["generate", "--model", "smollm2-135m-instruct", "--stop", ""], "an empty stop string"),
        (["generate", "-O", "capacity"], "'capacity' is not KEY=VALUE"),
        (["generate", "-O", "=3"], "'=3' is not KEY=VALUE"),
        (["generate", "-b", "dspark", "-O", "nosuch=1"], "-O nosuch: not an option of backend 'dspark'; its options:"),
        (["generate", "-b", "eagle", "-O", "fused=true", "-O", "fused=false"], "-O fused is given twice"),
        (["generate", "-b", "eagle", "-O", "fused=true", "--fused"], "-O fused and --fused set the same"),
        (["generate", "-b", "plain", "-O", "capacity=8"], "-O capacity needs a speculative backend"),
        (["generate", "-b", "eagle", "-O", "lookup=-2", "1 2 3"], "an integer >= 0 (0: no lookup), got -2"),
        (["generate", "-b", "eagle", "-O", "lookup_drafts=8", "1 2 3"], "lookup_drafts=8 needs prompt lookup on"),
        (
            ["generate", "-b", "eagle", "-O", "lookup=2", "-O", "lookup_drafts=2", "1 2 3"],
            "lookup_drafts (2) must be 0 or at least the drafter's K (4)",
        ),
        (["generate", "--prompts-file", "no-such-prompts.txt"], "--prompts-file no-such-prompts.txt: no such file"),
        (["generate", "1 2", "--prompts-file", "-"], "the prompt argument or --prompts-file, not both"),
        (["generate", "--prompts-file", "-", "--num-requests", "2"], "with --prompts-file each line is a request"),
    ],
    "bench-contracts": [(["bench-contracts", "--repeats", "0"], "--repeats: 0 is out of range")],
    "bench": [
        (["bench", "--backends", "nosuch"], "unknown backend 'nosuch'"),
        (["bench", "--suites", "nosuch"], "unknown suite(s) ['nosuch']"),
        (["bench", "--backends", "plain"], "'plain' always runs as the baseline"),
        (["bench", "--model", "nosuch"], "unknown model 'nosuch'"),
        (["bench", "-b", "eagle", "--backends", "nosuch"], "unknown backend 'nosuch'"),
        (["bench", "--backend", "none,eagle"], "--backend none means plain decoding only"),
        (["bench", "-b", "eagle", "-O", "capacity=threshold"], "-O capacity: no compared backend takes it (eagle: "),
        (["bench", "-b", "dspark", "-O", "pretrained=x"], "bench chooses drafter weights with --weights"),
        (["bench", "-O", "tau"], "'tau' is not KEY=VALUE"),
        (["bench", "--verify-attention", "fast"], "invalid choice: 'fast' (choose from 'exact', 'batched')"),
    ],
    "bench-phases": [
        (["bench-phases", "--backends", "nosuch"], "unknown backend 'nosuch'"),
        (["bench-phases", "--suite", "nosuch"], "invalid choice: 'nosuch'"),
        (["bench-phases", "--prompts", "0"], "--prompts: 0 is out of range"),
        (["bench-phases", "--model", "nosuch"], "unknown model 'nosuch'"),
        (["bench-phases", "--draft-length", "fixed,often"], "unknown 'often'; expected some of fixed, adaptive, idle"),
        (["bench-phases", "-b", "eagle", "-O", "capacity=8"], "-O capacity: no compared backend takes it (eagle: "),
        (["bench-phases", "-O", "lookup=1", "-O", "lookup=2"], "-O lookup is given twice (1 and 2); give it once"),
        (["bench-phases", "-O", "pretrained=x"], "bench-phases always runs the shipped drafter weights"),
        (["bench-phases", "--verify-attention", "rows"], "invalid choice: 'rows' (choose from 'exact', 'batched')"),
    ],
    "bench-decode": [
        (["bench-decode", "--dtypes", "float16"], "--dtypes: unknown 'float16'; expected some of float32"),
        (["bench-decode", "--dtypes", "float32", "--dtypes", "bf16"], "--dtypes: unknown 'bf16'"),
        (["bench-decode", "--repeats", "0"], "--repeats: 0 is out of range"),
        (["bench-decode", "--model", "nosuch"], "unknown model 'nosuch'"),
    ],
    "models": [
        (["models"], "required: {list,pull}"),
        (["models", "pull", "nosuch"], "unknown model 'nosuch'"),
    ],
    "matrix": [
        (["matrix", "-b", "nosuch"], "unknown backend 'nosuch'"),
        (["matrix", "-b", "eagle,nosuch"], "unknown backend 'nosuch'"),
        (["matrix", "--families", "dp", "--families", "nosuch"], "--families: unknown nosuch"),
        (["matrix", "--families", "dp,nosuch"], "--families: unknown nosuch"),
        (["matrix", "--tensor-modes", "tpu"], "--tensor-modes: unknown tpu"),
        (["matrix", "-n", "0"], "--examples/-n: 0 is out of range"),
    ],
    "mutate": [
        (["mutate", "--mutants", "bogus"], "unknown mutant(s) ['bogus']"),
        (["mutate", "-n", "-3"], "--examples/-n: -3 is out of range"),
    ],
    "train": [
        (["train"], "required: {features,drafter,tau,vocab}"),
        (["train", "drafter", "--backend", "medusa"], "invalid choice: 'medusa'"),
        (
            ["train", "drafter", "--backend", "eagle", "--features", "no.safetensors", "--out", "x", "--steps", "1"],
            "--features no.safetensors: no such file",
        ),
        (["train", "tau", "--model", "nosuch", "--backend", "eagle"], "unknown model 'nosuch'"),
        (["train", "--threads", "0", "tau"], "--threads: 0 is out of range"),
    ],
    "vllm-check": [(["vllm-check", "--contracts", "some"], "invalid choice: 'some'")],
}

CASES = [
    pytest.param(argv, expected, id=" ".join(argv) or "(none)")
    for cases in BAD_INPUT.values()
    for argv, expected in cases
]


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors exit through Parser.error
        return int(exc.code or 0)


def test_every_subcommand_has_bad_input_cases() -> None:
    assert set(BAD_INPUT) == {"", *all_commands()}


@pytest.mark.parametrize(("argv", "expected"), CASES)
def test_a_users_mistake_is_one_line_and_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("specdec: error: "), err
    assert expected in last, last
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(all_commands()))
def test_a_bad_specdec_contracts_is_a_usage_error_in_every_command(command: str) -> None:
    # A fresh process: importing contracts under a bad mode raises, so the CLI must check first.
    env = {**os.environ, "SPECDEC_CONTRACTS": "bogus"}
    argv = [sys.executable, "-m", "specdec", *command.split()]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "specdec: error: SPECDEC_CONTRACTS='bogus' is not a contract mode; expected one of off, shapes, full"
    )


def test_the_cli_accepts_exactly_the_contract_modes() -> None:
    from contracts.enforcement import Mode

    assert tuple(m.value for m in Mode) == CONTRACT_MODES
