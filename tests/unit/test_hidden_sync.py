"""The fake-cuda (meta) replay names a hidden device sync as such, at the drafter's line; other failures pass through."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch

from specdec.testing.hidden_sync import HiddenDeviceSync, naming_hidden_syncs
from specdec.testing.meta_memo import MetaMemo

x = torch.ones(4, device="meta")
ids = torch.ones(4, dtype=torch.int64, device="meta")

SYNCS: dict[str, tuple[Callable[[], object], str]] = {
    "item": (lambda: x.sum().item(), "reads a device value on the host"),
    "bool": (lambda: bool(x.sum() > 0), "reads a device value on the host"),
    "int": (lambda: int(ids[0]), "reads a device value on the host"),
    "slice by a tensor": (lambda: x[: ids[0]], "reads a device value on the host"),
    "tolist": (lambda: ids.tolist(), "copies a device tensor to the host"),
    "cpu": (lambda: x.cpu(), "copies a device tensor to the host"),
    "copy_ to host": (lambda: torch.empty(4).copy_(x), "copies a device tensor to the host"),
    "nonzero": (lambda: ids.nonzero(), "output shape that depends on the data"),
    "boolean mask": (lambda: x[x > 0], "output shape that depends on the data"),
    "unique": (lambda: torch.unique(ids), "output shape that depends on the data"),
    "repeat_interleave": (lambda: torch.repeat_interleave(ids), "output shape that depends on the data"),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_a_data_dependent_op_is_a_hidden_device_sync_at_the_drafters_line(name: str) -> None:
    op, why = SYNCS[name]
    line = inspect.getsourcelines(op)[1]
    with MetaMemo(cache={}), pytest.raises(HiddenDeviceSync) as info:
        op()
    message = str(info.value)
    assert message.startswith(f"hidden device sync at {__file__}:{line} in <lambda>: aten."), message
    assert why in message and "(torch: " in message
    assert info.value.__cause__ is not None  # torch's own error stays attached


def test_a_drafter_method_calling_item_is_named_by_its_own_line() -> None:
    class Drafter(torch.nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            scale = h.abs().max().item()  # the hidden sync
            return h / scale

    line = inspect.getsourcelines(Drafter.forward)[1] + 1
    with MetaMemo(cache={}), pytest.raises(HiddenDeviceSync, match=rf"at {__file__}:{line} in forward: "):
        Drafter()(torch.ones(2, 3, device="meta"))


@pytest.mark.parametrize(
    "op",
    [
        lambda: x + torch.ones(4),  # mixed devices: a bug, but no sync
        lambda: x + torch.ones(5, device="meta"),  # a shape error
    ],
    ids=["mixed-devices", "shape-mismatch"],
)
def test_other_failures_are_not_called_syncs(op: Callable[[], object]) -> None:
    with MetaMemo(cache={}), pytest.raises(RuntimeError) as info:
        op()
    assert not isinstance(info.value, HiddenDeviceSync)


def test_data_independent_ops_and_host_to_device_copies_run_unchanged() -> None:
    with MetaMemo(cache={}):
        y = torch.ones(4).to("meta") * 2
        z = torch.repeat_interleave(ids, 2, output_size=8)
        w = torch.empty(4, device="meta").copy_(torch.ones(4))
    assert y.device.type == z.device.type == w.device.type == "meta" and z.shape == (8,)


@pytest.mark.parametrize(
    ("read", "why"),
    [(lambda t: t.sum().item(), "reads a device value"), (lambda t: t[t > 0], "output shape that depends on the data")],
    ids=["item", "boolean-mask"],
)
def test_fake_tensor_mode_failures_are_named_the_same_way(read: Callable[[torch.Tensor], object], why: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    line = inspect.getsourcelines(read)[1]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(HiddenDeviceSync) as info:
        fake = mode.from_tensor(torch.ones(4))
        with naming_hidden_syncs():
            read(fake)
    assert str(info.value).startswith(f"hidden device sync at {__file__}:{line} in <lambda>: aten.")
    assert why in str(info.value)


def test_naming_hidden_syncs_lets_other_errors_through() -> None:
    with pytest.raises(ZeroDivisionError), naming_hidden_syncs():
        _ = 1 / 0
