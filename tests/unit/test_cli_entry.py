"""The command line's entry points: ``specdec --version`` and ``python -m specdec``."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import specdec
from specdec.cli.main import main


def test_version_comes_from_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    assert specdec.__version__ == metadata.version("specdec")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"specdec {metadata.version('specdec')}\n"


def test_python_dash_m_specdec_runs_the_same_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"specdec {metadata.version('specdec')}\n"
    bad = subprocess.run(
        [sys.executable, "-m", "specdec", "no-such-command"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr


@pytest.mark.parametrize(
    ("env", "flag", "expected"), [("full", None, "full"), ("full", "off", "off"), (None, None, "shapes")]
)
def test_generate_honours_specdec_contracts_unless_the_flag_is_given(
    env: str | None,
    flag: str | None,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import contracts

    if env is None:
        monkeypatch.delenv("SPECDEC_CONTRACTS", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_CONTRACTS", env)
    previous = contracts.current_mode()
    try:
        argv = ["generate", "--backend", "plain", "--num-requests", "1", "--max-tokens", "2", "--layers", "1"]
        assert main(argv + ([] if flag is None else ["--contracts", flag])) == 0
        assert contracts.current_mode().value == expected
    finally:
        contracts.set_mode(previous)
    assert f"contracts: {expected};" in capsys.readouterr().out
