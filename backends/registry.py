"""The built-in backends' factories, published as entry points in group ``specdec.backends``.

``pyproject.toml`` names each ``make_*`` function below; ``specdec.backend_registry``
finds them there exactly as it finds a third-party backend, so the runtime never
imports this package. ``create`` stays importable from here for existing callers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.lookup_first import LookupFirst
from backends.pretrained import load_draft_vocab, load_drafter, meta_json, read_metadata, resolve, shipped_id
from specdec.backend_registry import create
from specdec.nn.transformer import Transformer
from specdec.speculator import Speculator

__all__ = ["create", "make_dflash", "make_draft_model", "make_dspark", "make_eagle", "spread_layers"]


def spread_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread over depth (EAGLE-3 fuses low, middle and high)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    return tuple(round(i * (num_layers - 1) / (count - 1)) for i in range(count))


def trained_config(pretrained: str | Path, backend: str) -> tuple[Path, dict[str, Any]]:
    """The weights file for ``pretrained`` (a model name or a ``.safetensors`` path) and its network options."""
    path = resolve(pretrained, backend)
    meta = read_metadata(path)
    if meta.get("backend") != backend:
        raise ValueError(f"{path} holds {meta.get('backend')!r} drafter weights, not {backend!r}")
    options = meta_json(meta, "network", path)
    if not isinstance(options, dict):
        raise ValueError(f"{path}: metadata field 'network' must be a JSON object")
    return path, options


def weights_source(path: Path | None) -> str:
    """``random``, ``shipped:<model>/<backend>`` for shipped weights, or ``trained:<path as given>``."""
    if path is None:
        return "random"
    return shipped_id(path) or f"trained:{path}"


def mark_weights(speculator: Speculator, source: str) -> Speculator:
    """Record where the drafter's weights came from (``specdec.cli.streaming.drafter_weights_are_random`` reads it)."""
    setattr(speculator, "weights_source", source)  # noqa: B010 - an optional attribute the Speculator protocol lacks
    return speculator


def lookup_first(speculator: Speculator, lookup: int, lookup_drafts: int = 0) -> Speculator:
    """``speculator`` with prompt lookup first (``backends.lookup_first``) where ``lookup``, the shortest suffix match
    in tokens, is positive; as it is with 0. ``lookup_drafts``: the most drafts a match gives (0: the drafter's K)."""
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise ValueError(
            f"lookup is the shortest suffix match in tokens, an integer >= 0 (0: no lookup), got {lookup!r}"
        )
    if not lookup:
        if lookup_drafts:
            raise ValueError(f"lookup_drafts={lookup_drafts!r} needs prompt lookup on: pass lookup=N (N >= 1) too")
        return speculator
    return LookupFirst(speculator, min_match=lookup, lookup_drafts=lookup_drafts)


def make_eagle(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    fused: bool = False,
    seed: int = 1,
    pretrained: str | Path | None = None,
    full_vocab: bool = False,
    lookup: int = 0,
    lookup_drafts: int = 0,
) -> Speculator:
    """EAGLE-3-style head; ``pretrained`` (a model name or a ``.safetensors`` path) loads trained weights.

    A trained file's draft vocabulary is used unless ``full_vocab`` (score the whole LM head). ``lookup``: prompt
    lookup first, from suffix matches of at least this many tokens (0: off); ``lookup_drafts``: the most drafts a
    match gives, at least ``num_spec_tokens`` (0: ``num_spec_tokens``).
    """
    from backends.autoregressive import AutoregressiveSpeculator, EagleHead

    aux = spread_layers(target.config.num_layers)
    path, options = trained_config(pretrained, "eagle") if pretrained is not None else (None, {})
    aux = tuple(options.get("aux_layers", aux))
    head = EagleHead(target, num_aux=len(aux), seed=seed)
    if path is not None:
        load_drafter(path, {"head": head})
        head.draft_vocab = None if full_vocab else load_draft_vocab(path, target.config.vocab_size)
    spec = AutoregressiveSpeculator(head, num_spec_tokens=num_spec_tokens, fused=fused, aux_layers=aux, name="eagle")
    return lookup_first(mark_weights(spec, weights_source(path)), lookup, lookup_drafts)


def make_draft_model(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    fused: bool = False,
    seed: int = 1,
    draft: Transformer | None = None,
    lookup: int = 0,
    lookup_drafts: int = 0,
) -> Speculator:
    """A small draft model of the target's vocabulary (a one-layer copy of its shape by default); ``lookup`` and
    ``lookup_drafts`` as for ``make_eagle``."""
    from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter

    if draft is None:
        small = target.config.model_copy(update={"num_layers": 1})
        draft = Transformer(small, seed=seed, dtype=target.dtype, device=target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"a draft model needs the target's vocabulary: {draft.config.vocab_size} != {target.config.vocab_size}"
        )
    spec = AutoregressiveSpeculator(
        ModelDrafter(draft), num_spec_tokens=num_spec_tokens, fused=fused, name="draft-model"
    )
    return lookup_first(spec, lookup, lookup_drafts)


def make_dflash(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    seed: int = 1,
    num_layers: int = 1,
    argmax_drafts: bool = False,
    pretrained: str | Path | None = None,
    full_vocab: bool = False,
    lookup: int = 0,
    lookup_drafts: int = 0,
) -> Speculator:
    """DFlash block drafter; ``pretrained`` loads trained weights (their layer count and aux layers win).

    A trained file's draft vocabulary is used unless ``full_vocab``; ``lookup`` and ``lookup_drafts`` as for ``make_eagle``.
    """
    from backends.dflash import DFlashNetwork, DFlashSpeculator

    path, options = trained_config(pretrained, "dflash") if pretrained is not None else (None, {})
    aux = tuple(options.get("aux_layers", spread_layers(target.config.num_layers, count=5)))
    num_layers = int(options.get("num_layers", num_layers))
    network = DFlashNetwork(target, num_aux=len(aux), seed=seed, num_layers=num_layers)
    if path is not None:
        load_drafter(path, {"network": network})
        network.draft_vocab = None if full_vocab else load_draft_vocab(path, target.config.vocab_size)
    spec = DFlashSpeculator(
        network, num_spec_tokens=num_spec_tokens, aux_layers=aux, name="dflash", seed=seed, argmax_drafts=argmax_drafts
    )
    return lookup_first(mark_weights(spec, weights_source(path)), lookup, lookup_drafts)


def make_dspark(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    seed: int = 1,
    num_layers: int = 1,
    rank: int = 8,
    capacity: str = "full",
    tau: float = 0.5,
    c0: float | None = None,
    c1: float | None = None,
    markov_scale: float = 1.0,
    pretrained: str | Path | None = None,
    full_vocab: bool = False,
    lookup: int = 0,
    lookup_drafts: int = 0,
) -> Speculator:
    """DSpark drafter; ``pretrained`` loads trained weights (their layer count, rank and aux layers win).

    A trained file's draft vocabulary is used unless ``full_vocab``; ``lookup`` and ``lookup_drafts`` as for ``make_eagle``.
    """
    from backends.dflash import DFlashNetwork
    from backends.dspark import DSparkHeads, DSparkSpeculator, StepCost

    path, options = trained_config(pretrained, "dspark") if pretrained is not None else (None, {})
    aux = tuple(options.get("aux_layers", spread_layers(target.config.num_layers, count=5)))
    num_layers = int(options.get("num_layers", num_layers))
    rank = int(options.get("rank", rank))
    network = DFlashNetwork(target, num_aux=len(aux), seed=seed, num_layers=num_layers)
    c = target.config
    heads = DSparkHeads(
        c.hidden_size,
        c.vocab_size,
        rank=rank,
        seed=seed,
        markov_scale=markov_scale,
        dtype=target.dtype,
        device=target.device,
    )
    if path is not None:
        load_drafter(path, {"network": network, "heads": heads})
        network.draft_vocab = None if full_vocab else load_draft_vocab(path, target.config.vocab_size)
    spec = DSparkSpeculator(
        network,
        heads,
        num_spec_tokens=num_spec_tokens,
        aux_layers=aux,
        name="dspark",
        seed=seed,
        capacity=capacity,  # type: ignore[arg-type]
        tau=tau,
        # No cost given: the budget fits c0 + c1 * tokens to the engine's measured step times as they arrive.
        cost=None
        if c0 is None and c1 is None
        else StepCost(c0=1.0 if c0 is None else c0, c1=0.05 if c1 is None else c1),
    )
    return lookup_first(mark_weights(spec, weights_source(path)), lookup, lookup_drafts)
