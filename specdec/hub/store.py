"""The model store: one verified cache directory per model under ``$SPECDEC_HOME/models``.

Layout of ``<root>/models/<name>/``::

    config.json            Hugging Face Llama config, from the GGUF metadata
    model.safetensors      fp32 weights, Hugging Face names, q/k rows un-permuted
    tokenizer.json         ``tokenizers`` tokenizer, from the GGUF vocabulary and merges
    tokenizer_config.json  chat template, special tokens, stop token ids
    source/<file>.gguf     the pinned source GGUF (reference runs load it with transformers)
    manifest.json          sha256 and size of every file above, written last

A pull builds all of it in a temporary sibling directory, writes the manifest
last and renames the directory into place, so a reader sees a whole cache or
none. Loading re-hashes every file against the manifest; any mismatch, missing
file or missing manifest makes the cache invalid, and ``ensure`` rebuilds it
from the source instead of using it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from specdec.hub.catalog import KNOWN_MODELS, FileSource, ModelSpec, get_spec
from specdec.hub.errors import ChecksumError, ModelStoreError, StoreNotWritableError
from specdec.hub.fetch import fetch_gguf
from specdec.hub.gguf_weights import hf_config, hf_tensors, open_gguf
from specdec.hub.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from specdec.hub.progress import Reporter, SilentProgress
from specdec.hub.tokenizer_convert import convert_tokenizer

HOME_ENV = "SPECDEC_HOME"
CONVERTER = f"specdec.hub gguf->safetensors fp32, format {FORMAT_VERSION}"
WEIGHTS = "model.safetensors"
SOURCE_DIR = "source"


def default_root() -> Path:
    """``$SPECDEC_HOME``, else ``~/.cache/specdec``."""
    configured = os.environ.get(HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specdec"


@dataclass(frozen=True)
class CacheStatus:
    """What ``specdec models list`` shows for one model."""

    name: str
    path: Path
    state: str
    """``cached``, ``not pulled`` or ``invalid: <why>``."""
    size: int

    @property
    def cached(self) -> bool:
        return self.state == "cached"


class ModelStore:
    """Pull, verify and locate cached models; ``specs`` defaults to the catalog (tests pass their own)."""

    def __init__(self, root: Path | None = None, specs: dict[str, ModelSpec] | None = None) -> None:
        self.root = (root or default_root()).expanduser()
        self.specs = dict(KNOWN_MODELS if specs is None else specs)

    # -- locating ----------------------------------------------------------------------------------

    def spec(self, name: str) -> ModelSpec:
        return self.specs[name] if name in self.specs else get_spec(name)

    def path(self, name: str) -> Path:
        return self.root / "models" / name

    def source_gguf(self, name: str) -> Path:
        """The pinned source GGUF inside the cache (valid only once the model is pulled)."""
        return self.path(name) / SOURCE_DIR / self.spec(name).source.gguf_name

    # -- checking ----------------------------------------------------------------------------------

    def problems(self, name: str, *, hash_files: bool = True) -> list[str]:
        """Why the cache of ``name`` is not usable; empty when it is."""
        path = self.path(name)
        if not path.is_dir():
            return ["not pulled"]
        manifest = Manifest.read(path)
        if manifest is None:
            return [f"{MANIFEST_NAME} is missing or unreadable (an interrupted pull)"]
        spec = self.spec(name)
        found = []
        if manifest.model != name or manifest.source_sha256 != spec.sha256:
            found.append(f"built from {manifest.model!r} sha256 {manifest.source_sha256}, not the pinned source")
        required = {"config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json"}
        found += [f"the manifest does not list {f}" for f in sorted(required - manifest.files.keys())]
        return found + manifest.problems(path, hash_files=hash_files)

    def status(self, name: str) -> CacheStatus:
        """A cheap check (presence and sizes, no hashing), for listings."""
        problems = self.problems(name, hash_files=False)
        manifest = Manifest.read(self.path(name))
        size = manifest.total_size if manifest is not None else 0
        if not problems:
            state = "cached"
        elif problems == ["not pulled"]:
            state = "not pulled"
        else:
            state = f"invalid: {problems[0]}"
        return CacheStatus(name, self.path(name), state, size)

    # -- building ----------------------------------------------------------------------------------

    def ensure(self, name: str, *, reporter: Reporter | None = None, download: bool = True) -> Path:
        """The verified cache directory of ``name``, pulled (or rebuilt) first if needed."""
        problems = self.problems(name)
        if not problems:
            return self.path(name)
        why = "; ".join(problems)
        if not download:
            raise ModelStoreError(
                f"model {name!r} is not usable in {self.path(name)} ({why}); run `specdec models pull {name}`"
            )
        if problems != ["not pulled"]:
            (reporter or SilentProgress()).note(f"the cache of {name} is not usable ({why}); rebuilding it")
        try:
            return self.pull(name, reporter=reporter)  # rebuilds: the cache is invalid (rechecked under the lock)
        except StoreNotWritableError as exc:
            if problems == ["not pulled"]:
                raise
            raise StoreNotWritableError(
                f"model {name!r} in {self.path(name)} is not usable ({why}) and cannot be rebuilt: {exc}"
            ) from exc

    def pull(self, name: str, *, force: bool = False, reporter: Reporter | None = None) -> Path:
        """Fetch, verify and convert ``name``; a valid cache is kept unless ``force``."""
        reporter = reporter or SilentProgress()
        spec = self.spec(name)
        models = self.root / "models"
        with _locked(models, name):
            # Another process may have finished the same pull while this one waited for the lock.
            if not force and not self.problems(name):
                reporter.note(f"{name} is already cached in {self.path(name)}")
                return self.path(name)
            for stale in [*models.glob(f".{name}-*"), *models.glob(f".{name}.old-*")]:
                # Left by a pull that was killed outright; the lock guarantees no live pull owns them.
                shutil.rmtree(stale, ignore_errors=True)
            reuse = self._reusable_source(name)
            with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=models) as tmp:
                staging = Path(tmp) / "cache"
                staging.mkdir()
                self._build(spec, staging, reuse, reporter)
                self._install(name, staging)
        return self.path(name)

    def _reusable_source(self, name: str) -> Path | None:
        """An already-verified source GGUF from a previous cache, to rebuild without downloading again."""
        gguf = self.source_gguf(name)
        manifest = Manifest.read(self.path(name))
        if manifest is None or not gguf.is_file():
            return None
        entry = manifest.files.get(f"{SOURCE_DIR}/{gguf.name}")
        spec = self.spec(name)
        if entry is None or entry.sha256 != spec.sha256 or gguf.stat().st_size != entry.size:
            return None
        return gguf

    def _build(self, spec: ModelSpec, staging: Path, reuse: Path | None, reporter: Reporter) -> None:
        source_dir = staging / SOURCE_DIR
        source_dir.mkdir()
        gguf_path = None
        if reuse is not None:
            local = ModelSpec(spec.name, FileSource(reuse), spec.sha256, spec.description, spec.license, spec.size)
            with contextlib.suppress(ChecksumError):  # the old copy rotted too: download it again
                gguf_path = fetch_gguf(local, source_dir, reporter)
        if gguf_path is None:
            gguf_path = fetch_gguf(spec, source_dir, reporter)
        with reporter.step(f"reading {gguf_path.name}"):
            reader = open_gguf(gguf_path)
            config = hf_config(reader)
            tokenizer, tokenizer_config = convert_tokenizer(reader)
        if tokenizer.get_vocab_size(with_added_tokens=True) != config["vocab_size"]:
            raise ModelStoreError(
                f"the GGUF tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the model "
                f"has a vocabulary of {config['vocab_size']}"
            )
        state: dict[str, torch.Tensor] = {}
        with reporter.step("dequantizing to fp32", total=len(reader.tensors)) as advance:
            for hf_name, weight in hf_tensors(reader, config):
                state[hf_name] = weight
                advance(1)
        del reader
        with reporter.step(f"writing {WEIGHTS}"):
            safetensors.torch.save_file(state, str(staging / WEIGHTS), metadata={"format": "pt", "source": spec.name})
        _write_json(staging / "config.json", config)
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        tokenizer.save(str(staging / "tokenizer.json"))
        with reporter.step("hashing the cache"):
            Manifest.record(staging, spec.name, spec.sha256, CONVERTER).write(staging)

    def _install(self, name: str, staging: Path) -> None:
        """Swap the staged directory into place; the old one (if any) is moved aside first, then deleted."""
        final = self.path(name)
        old = None
        if final.exists():
            old = final.with_name(f".{name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staging.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------------

    def hf_config(self, name: str) -> dict[str, object]:
        return dict(json.loads((self.path(name) / "config.json").read_text(encoding="utf-8")))

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return safetensors.torch.load_file(str(self.path(name) / WEIGHTS))


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _locked(models: Path, name: str) -> Iterator[None]:
    """An exclusive advisory lock: two concurrent pulls of one model convert it once, not twice at once."""
    try:
        models.mkdir(parents=True, exist_ok=True)
        f = (models / f".{name}.lock").open("a")
    except OSError as exc:
        raise StoreNotWritableError(
            f"the model store {models} is not writable ({exc.strerror or exc}); "
            f"set {HOME_ENV} to a writable directory or fix its permissions"
        ) from exc
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
