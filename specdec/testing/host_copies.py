"""Device-to-host copies in the meta replay: data-less host tensors, as a fake ``cuda`` tensor's ``.cpu()`` gives.

On a CPU-only torch the fake-cuda replay runs on the ``meta`` device
(``conformance.replay_device``), and ``.cpu()`` of a meta tensor fails with
"Cannot copy out of meta tensor" before anything checks where the copy went.
Under ``FakeTensorMode`` (torch built with CUDA) the same ``.cpu()`` yields a
fake host tensor, so a host tensor left in attention metadata reaches IN-2,
which names the fix. ``HostCopiesOfMeta`` gives the meta replay that
behaviour: the copy is a ``FakeTensor`` on the host with no data, so reading
its values still fails (a hidden sync) and mixing it into device compute fails
as on a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_ORIGINAL_CPU = torch.Tensor.cpu
_ORIGINAL_TO = torch.Tensor.to
_lock = threading.Lock()
_active = 0
_fake_mode: FakeTensorMode | None = None


def _host_stand_in(source: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    global _fake_mode
    if _fake_mode is None:
        _fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    shaped = source if dtype is None else _ORIGINAL_TO(source, dtype=dtype)
    return FakeTensor(_fake_mode, shaped, torch.device("cpu"))


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if self.is_meta and not isinstance(self, FakeTensor):
        return _host_stand_in(self, None)
    return _ORIGINAL_CPU(self, *args, **kwargs)


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if self.is_meta and not isinstance(self, FakeTensor):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cpu":
            return _host_stand_in(self, dtype)
    return _ORIGINAL_TO(self, *args, **kwargs)


class HostCopiesOfMeta:
    """While entered (by any thread), ``meta_tensor.cpu()`` and ``meta_tensor.to("cpu", ...)`` return a data-less
    host ``FakeTensor``; every other tensor's copies are torch's own.

    Only these two methods are wrapped (a torch function mode would add a Python call to every op of the replay);
    the rank threads of one replay share one wrapping, counted in and out.
    """

    def __enter__(self) -> HostCopiesOfMeta:
        global _active
        with _lock:
            if _active == 0:
                torch.Tensor.cpu = _cpu  # type: ignore[method-assign,assignment]
                torch.Tensor.to = _to  # type: ignore[method-assign,assignment]
            _active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        with _lock:
            _active -= 1
            if _active == 0:
                torch.Tensor.cpu = _ORIGINAL_CPU  # type: ignore[method-assign]
                torch.Tensor.to = _ORIGINAL_TO  # type: ignore[method-assign]
