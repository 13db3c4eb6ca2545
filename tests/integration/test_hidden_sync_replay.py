"""A drafter that calls ``.item()`` in its forward fails the fake-cuda replay as a hidden device sync at its line."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from specdec.backend_registry import factory_for
from specdec.nn.transformer import Transformer
from specdec.speculator import Speculator
from specdec.testing.conformance import replay_device, run_family


def _syncing_forward(network: torch.nn.Module) -> None:
    inner = network.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor) and args[0].numel():
            threshold = args[0].float().mean().item()  # a value read in the forward path: a device sync on a GPU
            del threshold
        return out

    network.forward = forward  # type: ignore[method-assign]


SYNC_LINE = inspect.getsourcelines(_syncing_forward)[1] + 6


def syncing_eagle(target: Transformer, **options: Any) -> Speculator:
    speculator = factory_for("eagle")(target, **options)
    _syncing_forward(speculator.network)  # type: ignore[attr-defined]
    return speculator


def test_an_item_call_in_a_drafter_forward_is_a_hidden_device_sync_at_its_line() -> None:
    assert run_family(syncing_eagle, "dp", examples=2, tensor_mode="cpu").passed  # CPU tensors cannot tell
    result = run_family(syncing_eagle, "dp", examples=2, tensor_mode="fake-cuda", stop_at_first_failure=True)
    failure = result.first_failure or ""
    assert not result.passed
    assert "hidden device sync" in failure and f"{__file__}:{SYNC_LINE} in forward" in failure, failure
    if replay_device() == "meta":  # the CPU-only build's replay; a CUDA build replays under FakeTensorMode
        assert "aten._local_scalar_dense" in failure and result.caught_by == ["HiddenDeviceSync"], failure
