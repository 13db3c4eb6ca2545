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

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

_COPIES = (torch.Tensor.cpu, torch.Tensor.to)


class HostCopiesOfMeta(TorchFunctionMode):
    """``meta_tensor.cpu()`` and ``meta_tensor.to("cpu", ...)`` return a data-less host ``FakeTensor``."""

    def __init__(self) -> None:
        super().__init__()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (
            func in _COPIES
            and isinstance(source, torch.Tensor)
            and source.is_meta
            and not isinstance(source, FakeTensor)
        ):
            dtype = None
            if func is torch.Tensor.to:
                device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            else:
                device = torch.device("cpu")
            if device is not None and device.type == "cpu":
                with torch._C.DisableTorchFunction():
                    shaped = source if dtype is None else source.to(dtype=dtype)
                return FakeTensor(self.fake_mode, shaped, torch.device("cpu"))
        return func(*args, **kwargs)
