"""Hidden device syncs in the fake-cuda replay, named as such and placed at the drafter's line.

A data-less replay fails on any op that needs a device value on the host, but
torch's own message (``Tensor.item() cannot be called on meta tensors``) names
neither the cause nor the place. On a GPU each of these ops is a device sync
the drafter did not mean to make: it stalls the step and breaks CUDA-graph
capture. ``hidden_sync_error`` turns such a failure into ``HiddenDeviceSync``,
which says "hidden device sync", names the op, and gives the innermost frame
of the stack that belongs to neither torch, the runtime, nor the standard
library: the drafter's own line.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

import torch

INTERNAL_PACKAGES = frozenset({"torch", "specdec", "contracts", "jaxtyping", "beartype", "typeguard", "pydantic"})
"""Top-level packages whose frames are never the drafter's (the runtime wrapping a drafter included)."""


class HiddenDeviceSync(RuntimeError):
    """A drafter's op needs a device value on the host: a device sync on a GPU, impossible in a data-less replay."""


def _is_drafter_frame(frame: FrameType) -> bool:
    module = str(frame.f_globals.get("__name__", ""))
    top = module.split(".")[0]
    return not (top in INTERNAL_PACKAGES or top in sys.stdlib_module_names or frame.f_code.co_filename.startswith("<"))


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def drafter_location(frame: FrameType | None) -> str | None:
    """``file:line in function`` of the innermost drafter frame at or outside ``frame``; ``None`` when none is."""
    while frame is not None:
        if _is_drafter_frame(frame):
            return _where(frame)
        frame = frame.f_back
    return None


def traceback_location(tb: TracebackType | None) -> str | None:
    """``drafter_location`` of the innermost drafter frame of a traceback (from the raise point outwards)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        if _is_drafter_frame(frame):
            return _where(frame)
    return None


def _devices(x: Any) -> set[str]:
    if isinstance(x, torch.Tensor):
        return {x.device.type}
    if isinstance(x, (list, tuple)):
        return set().union(*(_devices(y) for y in x)) if x else set()
    if isinstance(x, dict):
        return _devices(list(x.values()))
    return set()


_READS_VALUE = "reads a device value on the host (Tensor.item(), bool(), int() or float() of a tensor, .tolist())"
_DATA_SHAPE = (
    "has an output shape that depends on the data (nonzero, boolean-mask indexing, unique, "
    "repeat_interleave without output_size, ...), which the host must read before it can allocate"
)
_UNKNOWN = "an unknown line (no frame outside torch and the runtime)"
_TO_HOST_OPS = {"aten::_to_copy", "aten::copy_", "aten::to"}


def data_dependence(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``func`` needs the data of its device inputs on the host, in words; ``None`` when it does not."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return _READS_VALUE
    if torch.Tag.dynamic_output_shape in tags:
        return _DATA_SHAPE
    name = getattr(getattr(func, "_schema", None), "name", "")
    if name in _TO_HOST_OPS and "meta" in _devices(args):
        target = kwargs.get("device")
        copies_out = (target is not None and torch.device(target).type != "meta") or (
            name == "aten::copy_" and bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta"
        )
        if copies_out:
            return "copies a device tensor to the host (.cpu(), .to('cpu'), .tolist(), .numpy())"
    return None


def hidden_sync_error(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> Exception | None:
    """A ``HiddenDeviceSync`` for ``exc`` raised by ``func`` on data-less tensors, or ``None`` for another failure."""
    why = data_dependence(func, args, kwargs)
    if why is None:
        return None
    where = drafter_location(sys._getframe(1)) or _UNKNOWN
    return HiddenDeviceSync(_message(where, str(func), why, exc))


def _message(where: str, op: str, why: str, exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"hidden device sync at {where}: {op} {why}. On a GPU this stalls the step on the device and cannot be "
        f"captured in a CUDA graph; keep the value on the device or compute it from host-side metadata. "
        f"(torch: {first})"
    )


@contextmanager
def naming_hidden_syncs() -> Iterator[None]:
    """Re-raise ``FakeTensorMode``'s data-dependent failures as ``HiddenDeviceSync`` at the drafter's line.

    The replay under ``FakeTensorMode`` (a CUDA build of torch) reports a value
    read as ``DataDependentOutputException`` and a data-dependent shape as
    ``DynamicOutputShapeException``, whose text is only the aten op's name.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        why = _READS_VALUE if isinstance(exc, DataDependentOutputException) else _DATA_SHAPE
        where = traceback_location(exc.__traceback__) or _UNKNOWN
        raise HiddenDeviceSync(_message(where, str(exc.func), why, exc)) from exc
