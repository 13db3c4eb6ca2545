"""The cache manifest: the sha256 and size of every file of a converted model, written last.

A cache directory is valid only when its manifest exists, names this format
version and the source GGUF's pinned sha256, and every file it lists hashes to
the recorded value. A conversion that died half-way has no manifest; a file
changed on disk no longer matches; either way the store rebuilds instead of
loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
"""Bumped whenever the converter's output changes, so older caches are rebuilt rather than misread."""

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (the weights do not fit a single read comfortably)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What a cache directory holds and where it came from."""

    model: str
    source_sha256: str
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    converter: str = ""

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files.values())

    @classmethod
    def record(cls, root: Path, model: str, source_sha256: str, converter: str) -> Manifest:
        """Hash every regular file under ``root`` (paths relative, ``/``-separated)."""
        files = {
            path.relative_to(root).as_posix(): FileEntry(sha256_file(path), path.stat().st_size)
            for path in sorted(root.rglob("*"))
            if path.is_file() and path.name != MANIFEST_NAME
        }
        return cls(model=model, source_sha256=source_sha256, files=files, converter=converter)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model": self.model,
            "source_sha256": self.source_sha256,
            "converter": self.converter,
            "files": {name: {"sha256": e.sha256, "size": e.size} for name, e in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            model=str(data["model"]),
            source_sha256=str(data["source_sha256"]),
            files={name: FileEntry(str(e["sha256"]), int(e["size"])) for name, e in data["files"].items()},
            format_version=int(data["format_version"]),
            converter=str(data.get("converter", "")),
        )

    def write(self, root: Path) -> None:
        """Write the manifest through a temporary file and an fsync'd rename: it exists whole or not at all."""
        tmp = root / f".{MANIFEST_NAME}.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(root / MANIFEST_NAME)

    @classmethod
    def read(cls, root: Path) -> Manifest | None:
        """The manifest of ``root``; ``None`` when there is none or it is unreadable (a partial cache)."""
        try:
            data = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
            return cls.from_json(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def problems(self, root: Path, *, hash_files: bool) -> list[str]:
        """Why ``root`` does not match this manifest (empty when it does).

        Without ``hash_files`` only presence and sizes are compared: cheap enough
        for ``specdec models list``; loading always hashes.
        """
        found: list[str] = []
        if self.format_version != FORMAT_VERSION:
            found.append(f"cache format {self.format_version}, this specdec writes {FORMAT_VERSION}")
        for name, entry in sorted(self.files.items()):
            path = root / name
            if not path.is_file():
                found.append(f"{name} is missing")
                continue
            size = path.stat().st_size
            if size != entry.size:
                found.append(f"{name} has {size} bytes, the manifest records {entry.size}")
            elif hash_files and (digest := sha256_file(path)) != entry.sha256:
                found.append(f"{name} has sha256 {digest}, the manifest records {entry.sha256}")
        return found
