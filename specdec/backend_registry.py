"""Backends by name, discovered through the ``specdec.backends`` entry-point group.

The runtime never imports a drafter package: built-in and third-party backends
alike publish ``name = "module:factory"`` under
``[project.entry-points."specdec.backends"]``, and a factory's module is imported
only when its backend is created, so a broken or heavy backend costs nothing
until someone asks for it. ``register`` adds in-process factories (tests,
notebooks) that have not been packaged.

A factory is ``factory(target: Transformer, **options) -> Speculator``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeAlias

from specdec.nn.transformer import Transformer
from specdec.speculator import Speculator

__all__ = [
    "GROUP",
    "Factory",
    "available_backends",
    "create",
    "factory_for",
    "load_factory",
    "names_option",
    "register",
    "unregister",
]

GROUP = "specdec.backends"

Factory: TypeAlias = Callable[..., Speculator]
"""``factory(target: Transformer, **options) -> Speculator``."""

_PROTOCOL_MEMBERS = ("name", "num_spec_tokens", "draft_step_kinds", "aux_layers", "bind", "propose", "finish")

_registered: dict[str, Factory] = {}
_scanned: tuple[dict[str, EntryPoint], dict[str, list[str]]] | None = None
"""The last scan: entry points by name, and names claimed by several. A miss in ``create`` rescans."""


def _describe_entry_point(ep: EntryPoint) -> str:
    dist = f"distribution {ep.dist.name!r}" if ep.dist is not None else "an unknown distribution"
    return f"entry point {ep.name} = {ep.value!r} of {dist}"


def _describe_factory(factory: Factory) -> str:
    module = getattr(factory, "__module__", None) or "?"
    qualname = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"in-process register() of {module}:{qualname}"


def _installed(*, refresh: bool = False) -> tuple[dict[str, EntryPoint], dict[str, list[str]]]:
    """Installed entry points by name, and conflicts: one name, different targets, several distributions."""
    global _scanned
    if _scanned is not None and not refresh:
        return _scanned
    found: dict[str, EntryPoint] = {}
    conflicts: dict[str, list[str]] = {}
    for ep in entry_points(group=GROUP):
        seen = found.get(ep.name)
        if seen is None:
            found[ep.name] = ep
        elif seen.value != ep.value:  # the same target found twice (one project on two paths) is harmless
            conflicts.setdefault(ep.name, [_describe_entry_point(seen)]).append(_describe_entry_point(ep))
    _scanned = (found, conflicts)
    return _scanned


def _duplicate_error(name: str, sources: list[str]) -> ValueError:
    return ValueError(
        f"backend name {name!r} is claimed twice: {' and '.join(sources)}; backend names must be unique "
        f"across the {GROUP!r} entry points and in-process registrations (rename or uninstall one)"
    )


def _check_unique(name: str, installed: dict[str, EntryPoint], conflicts: dict[str, list[str]]) -> None:
    if name in conflicts:
        raise _duplicate_error(name, conflicts[name])
    if name in installed and name in _registered:
        raise _duplicate_error(name, [_describe_entry_point(installed[name]), _describe_factory(_registered[name])])


def register(name: str, factory: Factory) -> Factory:
    """Make ``factory`` available as backend ``name`` in this process (for tests and notebooks).

    Returns ``factory``. Packaged backends should publish an entry point instead,
    so that every process (CLI, DP workers) finds them.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a backend name must be a non-empty string without ':', got {name!r}")
    if not callable(factory):
        raise TypeError(f"backend {name!r}: a factory must be callable as factory(target, **options), got {factory!r}")
    installed, _ = _installed()
    if name in _registered:
        raise _duplicate_error(name, [_describe_factory(_registered[name]), _describe_factory(factory)])
    if name in installed:
        raise _duplicate_error(name, [_describe_entry_point(installed[name]), _describe_factory(factory)])
    _registered[name] = factory
    return factory


def unregister(name: str) -> None:
    """Drop an in-process registration (entry points are the installer's business)."""
    if name not in _registered:
        raise ValueError(f"backend {name!r} was not registered in-process; registered: {sorted(_registered)}")
    del _registered[name]


def available_backends() -> dict[str, EntryPoint | Factory]:
    """Every backend by name: installed entry points (not loaded) and in-process factories.

    Rescans the installed distributions; raises if a name is claimed twice.
    """
    installed, conflicts = _installed(refresh=True)
    for name in sorted({*installed, *_registered, *conflicts}):
        _check_unique(name, installed, conflicts)
    out: dict[str, EntryPoint | Factory] = dict(installed)
    out.update(_registered)
    return dict(sorted(out.items()))


def _resolve(name: str) -> tuple[Factory, str]:
    """The factory of backend ``name`` and a description of where it came from."""
    if ":" in name:  # a "module:attr" spec: an unpackaged factory, e.g. --backend my_pkg:make_speculator
        return load_factory(name), f"factory spec {name!r}"
    installed, conflicts = _installed()
    if name not in installed and name not in _registered:
        installed, conflicts = _installed(refresh=True)  # perhaps installed since the last scan
    _check_unique(name, installed, conflicts)
    if name in _registered:
        factory = _registered[name]
        return factory, _describe_factory(factory)
    if name in installed:
        ep = installed[name]
        source = _describe_entry_point(ep)
        try:
            loaded = ep.load()
        except Exception as e:
            raise ImportError(f"backend {name!r}: loading {source} failed: {type(e).__name__}: {e}") from e
        if not callable(loaded):
            raise TypeError(f"backend {name!r}: {source} names {loaded!r}, which is not a callable factory")
        return loaded, source
    known = sorted({*installed, *_registered})
    raise ValueError(
        f"unknown backend {name!r}; known backends: {known} (installed ones come from {GROUP!r} entry points: "
        "reinstall a package whose entry points changed, e.g. pip install -e .)"
    )


def create(name: str, target: Transformer, **options: Any) -> Speculator:
    """Build backend ``name`` for ``target``, importing its factory only now.

    ``name`` is a registered backend name or a ``"module:attr"`` factory spec.
    """
    return factory_for(name)(target, **options)


def factory_for(name: str) -> Factory:
    """The factory of backend ``name`` (or a ``"module:attr"`` spec), checking that it builds a ``Speculator``.

    What the conformance suite, the matrix and the pytest plugin drive.
    """
    raw, source = _resolve(name)

    def build(target: Transformer, **options: Any) -> Speculator:
        speculator = raw(target, **options)
        if not isinstance(speculator, Speculator):
            missing = [m for m in _PROTOCOL_MEMBERS if not hasattr(speculator, m)]
            raise TypeError(
                f"backend {name!r} ({source}) returned a {type(speculator).__module__}."
                f"{type(speculator).__qualname__}, not a specdec.Speculator; missing members: {missing}"
            )
        return speculator

    build.__name__ = build.__qualname__ = name
    with contextlib.suppress(TypeError, ValueError):  # options a backend names (DSpark's capacity) stay visible
        build.__signature__ = inspect.signature(raw)  # type: ignore[attr-defined]
    return build


def names_option(backend: str | Factory, option: str) -> bool:
    """Whether a backend's factory names ``option`` as a parameter (a bare ``**options`` does not count).

    ``backend`` is a backend name, a ``"module:attr"`` spec or a factory. Callers
    pass optional extras such as ``pretrained`` (or run DSpark's ``capacity``
    family) only for factories that say they take them, so a strict factory never
    sees an unknown keyword and a factory that does take one still fails loudly on
    a bad value.
    """
    factory = factory_for(backend) if isinstance(backend, str) else backend
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(option)
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def load_factory(spec: str) -> Factory:
    """Resolve ``"package.module:attr"`` (attr may be dotted) to a callable, as an entry point's value is."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip() or ":" in attr:
        raise ValueError(
            f"a backend factory spec must look like 'package.module:factory', got {spec!r}"
            + ("" if sep else " (no ':' between the module and the factory)")
        )
    module_name, attr = module_name.strip(), attr.strip()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"backend factory spec {spec!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"backend factory spec {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise TypeError(
            f"backend factory spec {spec!r} names a {type(obj).__qualname__}, not a callable "
            "factory(target, **options) -> Speculator"
        )
    factory: Factory = obj
    return factory
