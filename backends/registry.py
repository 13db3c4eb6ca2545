"""Backends by name: what ``specdec generate --backend NAME`` and the tests build."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec.model.transformer import Transformer
from specdec.speculator import Speculator

Factory = Callable[..., Speculator]
BACKENDS: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        if name in BACKENDS:
            raise ValueError(f"backend {name!r} registered twice")
        BACKENDS[name] = factory
        return factory

    return add


def create(name: str, target: Transformer, **options: Any) -> Speculator:
    """Build backend ``name`` for ``target``; unknown names list the known ones."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known backends: {sorted(BACKENDS)}") from None
    return factory(target, **options)


def spread_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread over depth (EAGLE-3 fuses low, middle and high)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    return tuple(round(i * (num_layers - 1) / (count - 1)) for i in range(count))


@register("eagle")
def _eagle(
    target: Transformer, *, num_spec_tokens: int = 4, fused: bool = False, seed: int = 1, **_: Any
) -> Speculator:
    from backends.autoregressive import AutoregressiveSpeculator, EagleHead

    aux = spread_layers(target.config.num_layers)
    head = EagleHead(target, num_aux=len(aux), seed=seed)
    return AutoregressiveSpeculator(head, num_spec_tokens=num_spec_tokens, fused=fused, aux_layers=aux, name="eagle")


@register("draft-model")
def _draft_model(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    fused: bool = False,
    seed: int = 1,
    draft: Transformer | None = None,
    **_: Any,
) -> Speculator:
    from backends.autoregressive import AutoregressiveSpeculator, ModelDrafter

    if draft is None:
        small = target.config.model_copy(update={"num_layers": 1})
        draft = Transformer(small, seed=seed, dtype=target.dtype, device=target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"a draft model needs the target's vocabulary: {draft.config.vocab_size} != {target.config.vocab_size}"
        )
    return AutoregressiveSpeculator(
        ModelDrafter(draft), num_spec_tokens=num_spec_tokens, fused=fused, name="draft-model"
    )


@register("dflash")
def _dflash(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    seed: int = 1,
    num_layers: int = 1,
    argmax_drafts: bool = False,
    **_: Any,
) -> Speculator:
    from backends.dflash import DFlashNetwork, DFlashSpeculator

    aux = spread_layers(target.config.num_layers, count=5)
    network = DFlashNetwork(target, num_aux=len(aux), seed=seed, num_layers=num_layers)
    return DFlashSpeculator(
        network, num_spec_tokens=num_spec_tokens, aux_layers=aux, name="dflash", seed=seed, argmax_drafts=argmax_drafts
    )


@register("dspark")
def _dspark(
    target: Transformer,
    *,
    num_spec_tokens: int = 4,
    seed: int = 1,
    num_layers: int = 1,
    rank: int = 8,
    capacity: str = "full",
    tau: float = 0.5,
    c0: float = 1.0,
    c1: float = 0.05,
    markov_scale: float = 1.0,
    **_: Any,
) -> Speculator:
    from backends.dflash import DFlashNetwork
    from backends.dspark import DSparkHeads, DSparkSpeculator, StepCost

    aux = spread_layers(target.config.num_layers, count=5)
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
    return DSparkSpeculator(
        network,
        heads,
        num_spec_tokens=num_spec_tokens,
        aux_layers=aux,
        name="dspark",
        seed=seed,
        capacity=capacity,  # type: ignore[arg-type]
        tau=tau,
        cost=StepCost(c0=c0, c1=c1),
    )
