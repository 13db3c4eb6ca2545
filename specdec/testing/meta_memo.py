"""Memoised meta kernels: the fake-cuda replay's per-op cost, cut from Python decompositions to a dict lookup.

On a CPU-only torch the replay runs a drafter on ``meta`` tensors, and most
meta kernels there are Python reference implementations (``torch._refs``):
an elementwise add costs ~200 us, a hundred times the CPU op on the tiny
matrix model. A meta kernel is a pure function of its inputs' metadata
(device, dtype, shape, strides, offset) and of the non-tensor arguments, and a
drafter replays the same few shapes thousands of times, so ``MetaMemo``
computes each distinct call once and afterwards returns a fresh meta tensor
with the remembered shape, strides and dtype.

Only calls that a cache cannot change are cached: functional ops (nothing
mutated, no output aliasing an input, every output a plain tensor), whose
outputs are all meta tensors, with every argument understood. Everything else
(in-place ops, views, host tensors, value reads that must fail on meta) runs
the real kernel, and a call that raised is never cached, so it raises again.
An op that fails because it needs device data on the host is re-raised as a
``HiddenDeviceSync`` that names the drafter's line (``hidden_sync``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.testing.hidden_sync import hidden_sync_error

_UNCACHEABLE_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unhashable(Exception):
    """An argument the key cannot describe: the call runs uncached."""


def _key(x: Any) -> Any:
    """Everything a meta kernel can see of ``x``; scalars keep their type (``1``, ``1.0`` and ``True`` differ)."""
    if isinstance(x, torch.Tensor):
        return (x.device.type, x.dtype, x.layout, tuple(x.shape), x.stride(), x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_key(y) for y in x))
    if isinstance(x, _ATOMS):
        return (type(x), x)
    if isinstance(x, torch.Generator):  # a random op's output metadata does not depend on the stream's state
        return (torch.Generator, x.device.type)
    raise _Unhashable(type(x).__name__)


_FUNCTIONAL: dict[Any, bool] = {}
_FUNCTIONAL_LOCK = threading.Lock()


def _functional(func: Any) -> bool:
    """No mutation, no alias, only plain tensor outputs, shape not data-dependent: the output is metadata only."""
    known = _FUNCTIONAL.get(func)
    if known is None:
        schema = func._schema
        known = (
            not schema.is_mutable
            and not func.is_view
            and bool(schema.returns)
            and all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
            and not any(tag in func.tags for tag in _UNCACHEABLE_TAGS)
        )
        with _FUNCTIONAL_LOCK:
            _FUNCTIONAL[func] = known
    return known


Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


_SHARED: dict[Any, tuple[Spec, ...]] = {}


class MetaMemo(TorchDispatchMode):
    """A dispatch mode that remembers functional meta kernels' output metadata (see the module docstring).

    Enter one instance per thread (a mode's enter/exit state is its own); by
    default all of them share one process-wide cache, a plain dict whose
    single reads and writes are atomic, so every replay reuses what earlier
    ones computed.
    """

    def __init__(self, cache: dict[Any, tuple[Spec, ...]] | None = None, *, max_entries: int = 200_000) -> None:
        super().__init__()
        self.max_entries = max_entries
        self.cache = _SHARED if cache is None else cache
        self.hits = 0
        self.misses = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _functional(func):
            return _run(func, args, kwargs)
        try:
            key = (func, torch.get_default_dtype(), _key(args), _key(tuple(sorted(kwargs.items()))))
        except _Unhashable:
            return _run(func, args, kwargs)
        specs = self.cache.get(key)
        if specs is not None:
            self.hits += 1
            out = tuple(
                torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs
            )
            return out[0] if len(out) == 1 else out
        self.misses += 1
        result = _run(func, args, kwargs)
        outputs = result if isinstance(result, tuple) else (result,)
        if all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outputs):
            if len(self.cache) >= self.max_entries:
                self.cache.clear()
            self.cache[key] = tuple((tuple(t.shape), t.stride(), t.dtype) for t in outputs)
        return result


def _run(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The real kernel; a failure that is a hidden device sync is re-raised as one, at the drafter's line."""
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        named = hidden_sync_error(func, args, kwargs, exc)
        if named is None:
            raise
        raise named from exc
