"""``specdec generate`` runs the engine end to end and reports speculation metrics."""

from __future__ import annotations

import re

import pytest

from specdec.cli.main import main


def test_generate_with_the_target_as_draft_matches_plain_and_accepts_everything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["generate", "--backend", "draft-model", "--draft-is-target", "-k", "3", "--num-requests", "2"]
    assert (
        main([*args, "--max-tokens", "12", "--layers", "2", "--hidden", "32", "--compare-plain", "--contracts", "full"])
        == 0
    )
    out = capsys.readouterr().out
    spec = re.search(r"draft-model .*drafted\s+(\d+)\s+accepted\s+(\d+)\s+tau\s+([\d.]+)", out)
    assert spec is not None and spec.group(1) == spec.group(2) and float(spec.group(3)) > 3.0
    assert "plain" in out and "speed vs plain decoding" in out
    assert re.search(r"req-0: (\d+ ){11}\d+", out)


def test_generate_plain_and_eagle(capsys: pytest.CaptureFixture[str]) -> None:
    for backend in ("plain", "eagle"):
        assert main(["generate", "--backend", backend, "--max-tokens", "4", "--layers", "2", "--hidden", "32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^plain .*tokens\s+16", out, re.M) and re.search(r"^eagle .*tokens\s+16", out, re.M)


def test_generate_rejects_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--backend", "hydra", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err.startswith("specdec: error: unknown backend 'hydra'; known backends")
