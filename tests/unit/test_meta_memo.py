"""The fake-cuda replay's meta-kernel memo: the same shapes, the same errors, nothing cached that may differ."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specdec.testing.meta_memo import MetaMemo


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


CALLS: dict[str, Callable[[], Any]] = {
    "broadcast add": lambda: _meta(3, 1, 5) + _meta(4, 1),
    "matmul": lambda: _meta(2, 7, 8) @ _meta(8, 3),
    "transposed input": lambda: _meta(4, 6).t() * 2.0,
    "cat": lambda: torch.cat([_meta(2, 3), _meta(5, 3)]),
    "attention": lambda: F.scaled_dot_product_attention(
        _meta(2, 4, 3, 8), _meta(2, 2, 9, 8), _meta(2, 2, 9, 8), attn_mask=_meta(2, 1, 3, 9), enable_gqa=True
    ),
    "max with indices": lambda: _meta(5, 6).max(dim=1),
    "int full": lambda: torch.full((2,), 1, device="meta"),
    "float full": lambda: torch.full((2,), 1.0, device="meta"),
    "bool full": lambda: torch.full((2,), True, device="meta"),
    "random": lambda: torch.randn(3, 4, device="meta", generator=torch.Generator().manual_seed(0)),
}


def _layout(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return (out.device.type, out.dtype, tuple(out.shape), out.stride())
    return tuple(_layout(o) for o in out)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_remembered_call_returns_what_the_kernel_returns(name: str) -> None:
    want = _layout(CALLS[name]())
    memo = MetaMemo(cache={})
    with memo:
        first = _layout(CALLS[name]())
        second = _layout(CALLS[name]())
    assert first == second == want
    assert memo.hits > 0  # the second call came from the cache


def test_in_place_ops_and_views_run_the_real_kernel() -> None:
    x = _meta(4, 6)
    with MetaMemo(cache={}):
        for _ in range(2):
            assert x.add_(_meta(6)) is x
            view = x.view(6, 4)
            assert view._base is x
            with pytest.raises(RuntimeError):
                x.add_(_meta(5, 4, 6))  # a broadcast that would resize x: the kernel still rejects it


def test_value_reads_and_failing_calls_fail_every_time() -> None:
    with MetaMemo(cache={}) as memo:
        for _ in range(3):
            with pytest.raises((RuntimeError, NotImplementedError)):
                _meta(3).sum().item()
            with pytest.raises(RuntimeError):
                _meta(2, 3) @ _meta(4, 5)
    assert memo.hits >= 2  # the sums were remembered, never the failures


def test_host_tensors_are_never_remembered() -> None:
    with MetaMemo(cache={}) as memo:
        out = torch.ones(3) + torch.ones(3)
    assert out.tolist() == [2.0, 2.0, 2.0] and not memo.cache
