"""No committed file names a machine path: text files, and the metadata in the header of every safetensors file.

Shipped drafter files and their cards are identified by ``shipped:<model>/<backend>``
and repository-relative paths; a scratch folder of the machine that made them
(temporary, home or work folders) means nothing anywhere else.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MACHINE_ROOTS = ("tmp", "home", "work", "root", "Users")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:" + "|".join(MACHINE_ROOTS) + r")/[^\s\"'`)\]]*")
"""An absolute path under one of ``MACHINE_ROOTS``; not a URL's path (``example.com/home/``), not ``~/``."""

SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build"}


def committed_files() -> list[Path]:
    """The repository's files: what git tracks, or every file outside caches where this is not a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [p for p in REPO.rglob("*") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(REPO).parts)]
    return [REPO / name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def safetensors_metadata(path: Path) -> str:
    """The JSON header of a safetensors file (tensor names, shapes and string metadata), as text."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.dumps(json.loads(f.read(size)))


def machine_paths(path: Path) -> list[str]:
    """The machine paths ``path`` holds: in its header for safetensors, in its text otherwise (binary files: none)."""
    if path.suffix == ".safetensors":
        text = safetensors_metadata(path)
    else:
        data = path.read_bytes()
        if b"\0" in data:
            return []
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return []
    return MACHINE_PATH.findall(text)


def test_no_committed_file_names_a_machine_path() -> None:
    files = committed_files()
    assert len(files) > 50 and any(f.suffix == ".safetensors" for f in files)  # the scan sees the repository
    found = {str(f.relative_to(REPO)): hits[:3] for f in files if (hits := machine_paths(f))}
    assert not found, f"machine paths in committed files (name them by shipped:<model>/<backend> or relative): {found}"


@pytest.mark.parametrize("root", MACHINE_ROOTS)
def test_the_scan_finds_a_planted_path_in_text_and_in_a_safetensors_header(tmp_path: Path, root: str) -> None:
    planted = f"/{root}/scratch/v3/eagle.safetensors"
    doc = tmp_path / "notes.md"
    doc.write_text(f"trained with `--out {planted}` on a quiet machine\n", encoding="utf-8")
    assert machine_paths(doc) == [planted]

    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights), metadata={"command": f"train --out {planted}"})
    assert machine_paths(weights) == [planted]


def test_the_scan_leaves_relative_paths_urls_and_shipped_ids_alone(tmp_path: Path) -> None:
    doc = tmp_path / "ok.md"
    doc.write_text(
        "shipped:smollm2-135m-instruct/dspark, backends/weights/x/tmp/a, ~/work/notes, ./tmp/x, "
        "https://example.com/home/page and --out v3/eagle.safetensors\n",
        encoding="utf-8",
    )
    assert machine_paths(doc) == []
