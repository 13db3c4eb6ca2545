"""Trained drafter weights shipped with the package: where they live, how they are written and loaded.

One safetensors file per (target model, backend) under
``backends/weights/<model>/<backend>.safetensors`` holds only the drafter's
own parameters (never the target's shared embedding or LM head), in bf16,
with string metadata that says how to rebuild the network (layers, rank, aux
layers, K) and how it was trained. Loading casts to the target's dtype and
refuses a file whose names or shapes do not fit the network built for the
target, so a file trained for another model cannot load silently.

Each file has a model card beside it, ``<backend>.card.json``, with its sha256
and size. Shipped weights are verified against their card whenever they are
resolved, so a corrupted or swapped file is refused instead of drafting badly
(which, verification being lossless, would only ever show as lost speed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from backends.draft_vocab import DraftVocab
from specdec.hub.manifest import sha256_file

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
FORMAT = "specdec-drafter/1"
DRAFT_VOCAB = "draft_vocab"
"""Optional tensor of a drafter file: the sorted target token ids its drafts are scored over (``DraftVocab``)."""
CARD_SUFFIX = ".card.json"


class DrafterIntegrityError(ValueError):
    """A drafter file does not match its model card (corrupted, truncated or replaced), or has no card."""


def weights_path(model: str, backend: str) -> Path:
    """The shipped file for ``backend``'s drafter of target ``model`` (which may not exist)."""
    if not model or "/" in model or model.startswith("."):
        raise ValueError(f"not a model name: {model!r}")
    return WEIGHTS_DIR / model / f"{backend}.safetensors"


def resolve(pretrained: str | Path, backend: str) -> Path:
    """A model name (shipped weights) or a path to a ``.safetensors`` file; a clear error when it is missing.

    Shipped weights must match their model card; a file given by path is
    checked against a card beside it when there is one.
    """
    as_path = Path(pretrained)
    by_name = as_path.suffix != ".safetensors"
    path = weights_path(str(pretrained), backend) if by_name else as_path
    if not path.is_file():
        shipped = sorted(
            f"{d.name}/{f.stem}" for d in WEIGHTS_DIR.glob("*") if d.is_dir() for f in d.glob("*.safetensors")
        )
        raise FileNotFoundError(
            f"no trained {backend} drafter weights at {path}; shipped: {', '.join(shipped) or 'none'} "
            "(train one with `specdec train drafter`)"
        )
    verify_card(path, required=by_name)
    return path


def shipped_id(path: Path) -> str | None:
    """``shipped:<model>/<backend>`` for a file shipped with the package, else ``None``: names, never paths."""
    resolved = path.resolve()
    if resolved.parent.parent != WEIGHTS_DIR or resolved.suffix != ".safetensors":
        return None
    return f"shipped:{resolved.parent.name}/{resolved.stem}"


def card_path(weights: Path) -> Path:
    return weights.with_name(weights.stem + CARD_SUFFIX)


def write_card(weights: Path) -> Path:
    """Write the model card of a drafter file: what it is for, its size and its sha256.

    A trained file's card also repeats how it was made, from its metadata: the
    exact commands (training, then ``vocab`` where it was run; files named
    relative to where they ran, never by machine path), the data and the
    training's wall time.
    """
    meta = read_metadata(weights)
    card: dict[str, object] = {
        "model": meta.get("model"),
        "backend": meta.get("backend"),
        "file": weights.name,
        "size_bytes": weights.stat().st_size,
        "sha256": sha256_file(weights),
    }
    if "command" in meta:
        card["command"] = meta["command"]
    if "vocab_command" in meta:  # run after the training command: the file's draft vocabulary
        card["vocab_command"] = meta["vocab_command"]
    if "data" in meta:
        card["data"] = meta_json(meta, "data", weights)
    training = meta_json(meta, "training", weights) if "training" in meta else None
    if isinstance(training, dict) and "wall_s" in training:
        card["wall_s"] = training["wall_s"]
    path = card_path(weights)
    path.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


_VERIFIED: set[tuple[Path, int, int]] = set()
"""Files already hashed in this process, by path, size and modification time (a change re-verifies)."""


def verify_card(weights: Path, *, required: bool) -> None:
    """Refuse a drafter file whose size or sha256 differs from its card (or that has none, if ``required``)."""
    stat = weights.stat()
    key = (weights.resolve(), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    card = card_path(weights)
    if not card.is_file():
        if required:
            raise DrafterIntegrityError(f"{weights.name} has no model card ({card.name}); reinstall specdec")
        return
    try:
        recorded = json.loads(card.read_text(encoding="utf-8"))
        size, digest = int(recorded["size_bytes"]), str(recorded["sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DrafterIntegrityError(f"{card.name} is not a readable model card: {exc}") from exc
    if stat.st_size != size:
        raise DrafterIntegrityError(
            f"{weights.name} has {stat.st_size} bytes, its model card records {size}: the file is truncated or "
            "was replaced; reinstall specdec (or retrain it, which writes a new card)"
        )
    if (actual := sha256_file(weights)) != digest:
        raise DrafterIntegrityError(
            f"{weights.name} has sha256 {actual}, its model card records {digest}: the file is corrupted or was "
            "replaced; reinstall specdec (or retrain it, which writes a new card)"
        )
    _VERIFIED.add(key)


def save_drafter(
    path: Path,
    modules: Mapping[str, nn.Module],
    metadata: Mapping[str, object],
    dtype: torch.dtype = torch.bfloat16,
    *,
    draft_vocab: Tensor | None = None,
) -> int:
    """Write the modules' own parameters (prefixed ``<name>.``) in ``dtype``, and the file's model card.

    Metadata values that are not strings are stored as JSON; ``draft_vocab``
    (token ids) is stored as int32 under ``DRAFT_VOCAB``. Returns the file size in bytes.
    """
    state: dict[str, Tensor] = {}
    if draft_vocab is not None:
        state[DRAFT_VOCAB] = draft_vocab.detach().to("cpu", torch.int32).contiguous()
    for prefix, module in modules.items():
        for name, p in module.state_dict().items():
            state[f"{prefix}.{name}"] = p.detach().to("cpu", dtype).contiguous()
    meta = {"format": FORMAT} | {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)
    write_card(path)
    return path.stat().st_size


def read_metadata(path: Path) -> dict[str, str]:
    """The file's string metadata; raises ``ValueError`` for a file that is not a drafter checkpoint."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a specdec drafter file (format {meta.get('format')!r}, want {FORMAT!r})")
    return meta


def meta_json(meta: Mapping[str, str], key: str, path: Path) -> object:
    """One JSON-encoded metadata field, with the file named in the error when it is absent or malformed."""
    try:
        return json.loads(meta[key])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: metadata field {key!r} is missing or not JSON") from exc


@torch.no_grad()
def load_drafter(path: Path, modules: Mapping[str, nn.Module]) -> None:
    """Copy the file's tensors into the modules (cast to each parameter's dtype and device), all or nothing."""
    with safe_open(str(path), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys() if name != DRAFT_VOCAB}  # noqa: SIM118
    wanted = {f"{prefix}.{name}": p for prefix, module in modules.items() for name, p in module.state_dict().items()}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    bad = [
        f"{n} {tuple(stored[n].shape)} (network {tuple(p.shape)})"
        for n, p in wanted.items()
        if n in stored and stored[n].shape != p.shape
    ]
    if missing or extra or bad:
        raise ValueError(
            f"{path} does not fit this target's drafter: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"shape mismatches {bad[:5]} (trained for another model or configuration?)"
        )
    for name, p in wanted.items():
        p.copy_(stored[name].to(p.dtype))


def load_draft_vocab(path: Path, vocab_size: int) -> DraftVocab | None:
    """The file's draft vocabulary, or ``None`` for a file that scores the whole vocabulary."""
    with safe_open(str(path), framework="pt") as f:
        if DRAFT_VOCAB not in f.keys():  # noqa: SIM118 - safe_open is not iterable
            return None
        ids = f.get_tensor(DRAFT_VOCAB)
    try:
        return DraftVocab(ids, vocab_size)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc} (trained for another model?)") from exc
