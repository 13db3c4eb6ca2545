"""Linear layers on weights pre-packed for oneDNN: the fast CPU path for bf16, and for fp32 verify-sized batches.

A bf16 ``F.linear`` on the CPU goes to oneDNN's AMX matmul, which reorders the
plain ``[out, in]`` weight into its blocked layout on every call: half of a
decode step's matmul time went to that copy. ``torch.ops.mkldnn`` can reorder
once (``_reorder_linear_weight``) and multiply against the packed copy
(``_linear_pointwise``); the result is bit-identical to ``F.linear`` (same
kernel, same blocking) and nearly flat in the row count, which is what makes a
verify forward cost about one decode forward.

For fp32, MKL's ``sgemm`` grows with the rows where oneDNN's packed fp32
matmul stays nearly flat: on an AVX2 CPU, an LM head took 10.7 / 19.9 / 30.0 ms
for 1 / 2 / 3 rows through MKL and 5.6 / 6.2 / 6.5 ms packed. At a prefill's
row count the packed kernel was still the faster there (the model's products
at 100-300 rows in 0.73-0.91x MKL's time, a prompt's prefill 0.82x), so fp32
takes the packed path at every row count, a prefill in pieces of at most
``FP32_PREFILL_CHUNK`` rows. The packed kernel's rows are independent of each
other, and on that AVX2 CPU a row also got the same bits at any row count up to
400; on an AVX-512 CPU a 576x1536 product differs in the last bit between one
row and two, so that part depends on the host. The results differ from
``F.linear`` by summation order (~1e-6 relative); the transformers parity test
bounds that difference.

Which fp32 kernel is faster at a few rows depends on the CPU: on an AVX2 and an
AMD AVX-512 host the packed path won at every decode and verify size, while on an
Intel host with AMX MKL's products took 0.73x the packed time at one to three rows
and 1.2x from four. ``specdec.nn.fp32_kernels`` measures that on the loaded model
and sets ``fp32_f_linear_rows``: the row counts at which fp32 takes plain
``F.linear`` although the packed path applies (one above ``FP32_DECODE_ROWS``
stands for every prefill). Until something sets it, none.

Several weights that read the same input (q/k/v, gate/up) are packed as one
concatenated matrix, one call instead of three. The packed copy is cached and
rebuilt when any source weight is replaced or modified in place (its storage
pointer or ``_version`` changes), and is never pickled or deep-copied. Calls
that need autograd (an input or weight requiring grad with grad enabled), and
non-CPU or unsupported inputs (bf16 on a CPU without oneDNN's bf16 matmul), take
plain ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

FP32_DECODE_ROWS = 64
"""fp32 inputs of up to this many rows are decodes, verifies and blocks: their kernel is chosen per row count.

More rows are a prefill, whose kernel is chosen once for all (timed at ``FP32_PREFILL_CHUNK`` rows).
"""
FP32_PREFILL_CHUNK = 256
"""An fp32 prefill on the packed path is multiplied in pieces of at most this many rows.

oneDNN builds a kernel for each row count it meets; in pieces, a long prompt's
counts recur. Up to 400 rows a packed row's bits were measured independent of
the count (AVX2), and a prompt's prefill took the same time whole or in pieces
of 256 (2,297 against 2,319 ms for eight HumanEval prompts; pieces of 128 took
2,462 and MKL 2,828).
"""
FP32_PACKED_MIN_WEIGHT = 256 * 256
"""fp32 weights with fewer elements (the test matrix's tiny models) run faster through plain ``F.linear``.

bf16 always packs: its packed path gives a row the same bits for any row count up
to ``ROW_INVARIANT_ROWS``, which bf16 verify rows rely on to equal decode steps.
"""
_FP32_F_LINEAR_ROWS: frozenset[int] = frozenset()
"""Row counts at which fp32 products take ``F.linear`` instead of the packed path (process-wide, measured)."""
_FP32_PREFILL_F_LINEAR = False
"""Whether fp32 prefills (more than ``FP32_DECODE_ROWS`` rows) take ``F.linear``: a count above it in the set."""
ROW_INVARIANT_ROWS = 32
"""Up to this many rows, oneDNN's packed bf16 matmul gives each row the bits it gets alone.

Measured on this CPU (AMX) for SmolLM2's shapes: every count from 1 to 32 rows
matches one row at a time; 33 to ~300 rows use another blocking and differ in the
last bit. ``row_chunk`` splits larger inputs into pieces of at most this size
(``Transformer.batch_invariant``).
"""

DRAFTER_ROW_CHUNK = 64
"""Drafter networks multiply at most this many rows per call, so that the row counts their kernels meet recur.

oneDNN builds a kernel the first time it meets a row count: on the AMX CPU, a
first DFlash context fusion (a 2,880 x 576 bf16 product) took 3-17 ms at 136 to
392 rows against 0.5-1.7 ms once built, and 0.8-2.5 ms up to 97 rows. A
drafter's context catch-up (the rows of every request since its last draft, at
batch 8 eight times the steps it sat out) meets a new count nearly every time,
so an engine whose drafter rarely drafts paid a build on most of its drafting
steps; in pieces of at most 64 rows the counts recur and their kernels are kept.
"""


def set_row_chunk(module: nn.Module, chunk: int | None) -> None:
    """Set ``row_chunk`` on every ``PackedLinear`` that ``module`` or its submodules hold (alone or in a list)."""
    for sub in module.modules():
        for value in vars(sub).values():
            for item in value if isinstance(value, list | tuple) else (value,):
                if isinstance(item, PackedLinear):
                    item.row_chunk = chunk


def mkldnn_available() -> bool:
    """Whether this torch build has oneDNN (the packed ops exist in every CPU build that does)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mkldnn_bf16_available() -> bool:
    """Whether this CPU runs oneDNN's bf16 matmul (AVX512-BF16, AVX-NE-CONVERT or AVX512BW/VL/DQ; AMX is faster).

    On an AVX2-only CPU the bf16 reorder raises, so bf16 linears stay on plain
    ``F.linear`` there, and the bit-level guarantees that rest on the packed
    kernel (row invariance, ``Transformer.batch_invariant``) are not available.
    """
    return mkldnn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_MKLDNN = mkldnn_available()
_MKLDNN_BF16 = mkldnn_bf16_available()


_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise if _MKLDNN else None
"""Resolved once: looking the op up through ``torch.ops`` costs ~3 us a call, 121 calls a SmolLM2 decode step."""


def packed_product(x: Float[Tensor, "rows in_features"], packed: Tensor) -> Float[Tensor, "rows out_features"]:
    """``x @ W.T`` against oneDNN's packed copy of ``W``."""
    assert _LINEAR_POINTWISE is not None, "no oneDNN: nothing is packed"
    return _LINEAR_POINTWISE(x, packed, None, "none", [], "")


def fp32_f_linear_rows() -> frozenset[int]:
    """The row counts at which fp32 products take plain ``F.linear`` (``set_fp32_f_linear_rows``)."""
    return _FP32_F_LINEAR_ROWS


def set_fp32_f_linear_rows(rows: frozenset[int]) -> None:
    """Send fp32 products of these row counts to ``F.linear``: a property of the host, measured on a loaded model.

    A count above ``FP32_DECODE_ROWS`` sends every prefill there (the timing holds ``FP32_PREFILL_CHUNK``).
    """
    global _FP32_F_LINEAR_ROWS, _FP32_PREFILL_F_LINEAR
    if any(r < 1 for r in rows):
        raise ValueError(f"row counts must be >= 1, got {sorted(rows)}")
    _FP32_F_LINEAR_ROWS = frozenset(rows)
    _FP32_PREFILL_F_LINEAR = any(r > FP32_DECODE_ROWS for r in rows)


def fp32_kernel_choice(rows: Iterable[int] | None = None, *, onednn: bool | None = None) -> str:
    """Which kernel float32 products ran on, in words: it moves every float32 timing on a CPU.

    ``rows`` is a ``fp32_f_linear_rows()`` value and ``onednn`` a
    ``mkldnn_available()`` one, as a report kept them; each left out is this process's.
    """
    rows = sorted(_FP32_F_LINEAR_ROWS if rows is None else rows)
    if not (_MKLDNN if onednn is None else onednn):
        return "every float32 product on `F.linear` (this torch has no oneDNN)"
    if not rows:
        return "every float32 product on the packed kernel"
    decode = [str(r) for r in rows if r <= FP32_DECODE_ROWS]
    parts = [f"of {', '.join(decode)} row(s)"] if decode else []
    if rows[-1] > FP32_DECODE_ROWS:
        parts.append(f"of prefills (over {FP32_DECODE_ROWS} rows)")
    return f"float32 products {' and '.join(parts)} on `F.linear`, the rest on the packed kernel"


class PackedLinear:
    """The packed copy of one or more weights sharing an input; call ``run`` with the current weights.

    The weights are passed on every call rather than held, so a module whose
    parameters are reassigned (``load_state_dict(assign=True)``) never runs a
    stale copy, and this object adds nothing to a state dict.
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int, torch.Size], ...] | None = None
        """The packed weights' storage, version and shape: a weight replaced or modified in place packs again."""
        self._dtype: torch.dtype | None = None
        self._run_key: tuple[tuple[int, int, torch.Size], ...] | None = None
        """``_key`` once ``run`` found those weights fit for the packed path (``packed`` may pack any weights)."""
        self._packed: Tensor | None = None
        self._splits: list[int] = []
        self.row_chunk: int | None = None
        """Multiply at most this many rows per call (``ROW_INVARIANT_ROWS``: results independent of the batch)."""

    def run(
        self, x: Float[Tensor, "rows in_features"], weights: Sequence[Tensor]
    ) -> tuple[Float[Tensor, "rows out_features"], ...]:
        """``tuple(F.linear(x, w) for w in weights)``, through one packed matmul when that path applies."""
        packed = self._packed_for(x, weights)
        if packed is None:
            return tuple(F.linear(x, w) for w in weights)
        chunk = self.row_chunk
        rows = x.shape[0]
        if rows > FP32_PREFILL_CHUNK and x.dtype is torch.float32 and (chunk is None or chunk > FP32_PREFILL_CHUNK):
            chunk = FP32_PREFILL_CHUNK
        if chunk is not None and rows > chunk:
            out = torch.cat([packed_product(part, packed) for part in x.split(chunk)])
        else:
            out = packed_product(x, packed)
        if len(weights) == 1:
            return (out,)
        return tuple(out.split(self._splits, dim=-1))

    def _packed_for(self, x: Tensor, weights: Sequence[Tensor]) -> Tensor | None:
        """The packed copy this call multiplies, or None for ``F.linear``: ``applies`` and the measured fp32 choice.

        A call per product of every forward, so the weights' side of ``applies``
        (checked when they were packed) is not checked again while they are the
        ones packed: about 6 us a call less, 0.7 ms of a float32 decode step.
        """
        if not self._call_fits(x, weights):
            return None
        if x.dtype is torch.float32 and (
            x.shape[0] in _FP32_F_LINEAR_ROWS or (_FP32_PREFILL_F_LINEAR and x.shape[0] > FP32_DECODE_ROWS)
        ):
            return None
        key = tuple((w.data_ptr(), w._version, w.shape) for w in weights)
        if key == self._run_key and x.dtype is self._dtype:
            return self._packed
        if not self.applies(x, weights):
            return None
        packed = self._pack(weights)
        self._run_key = key  # these weights pass ``applies``: later calls check only ``_call_fits``
        return packed

    @staticmethod
    def _call_fits(x: Tensor, weights: Sequence[Tensor]) -> bool:
        """The part of ``applies`` that can change from call to call with the same weights: the input's shape,
        device and rows, and autograd (grad mode, or ``requires_grad`` set on a weight in place)."""
        if x.dim() != 2 or x.device.type != "cpu" or x.shape[0] == 0:
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))

    @staticmethod
    def applies(x: Tensor, weights: Sequence[Tensor]) -> bool:
        """The packed path: CPU, oneDNN, 2-D input, one dtype, no autograd, and bf16 (where the CPU has oneDNN's
        bf16 matmul) or fp32 weights that are not tiny."""
        if not _MKLDNN or not PackedLinear._call_fits(x, weights):
            return False
        dtype = x.dtype
        if dtype == torch.float32:
            if sum(w.numel() for w in weights) < FP32_PACKED_MIN_WEIGHT:
                return False
        elif dtype != torch.bfloat16 or not _MKLDNN_BF16:
            return False
        return not any(w.dtype != dtype or w.device.type != "cpu" or w.dim() != 2 for w in weights)

    def packed(self, weights: Sequence[Tensor]) -> Tensor:
        """The packed copy of ``weights`` (one matrix), packing it now if it is missing or stale."""
        return self._pack(weights)

    @staticmethod
    def packs(weights: Sequence[Tensor]) -> bool:
        """Whether a one-row input of these weights' dtype and device (a decode) can take the packed path."""
        probe = torch.empty((1, weights[0].shape[1]), dtype=weights[0].dtype, device=weights[0].device)
        return PackedLinear.applies(probe, weights)

    def prepare(self, weights: Sequence[Tensor]) -> None:
        """Pack now what the first one-row call would pack: at load time, not inside the first timed step."""
        with torch.no_grad():
            if self.packs(weights):
                self._pack(weights)

    def _pack(self, weights: Sequence[Tensor]) -> Tensor:
        key = tuple((w.data_ptr(), w._version, w.shape) for w in weights)
        if self._packed is None or key != self._key or weights[0].dtype is not self._dtype:
            with torch.no_grad():
                plain = weights[0] if len(weights) == 1 else torch.cat(list(weights))
                self._packed = torch.ops.mkldnn._reorder_linear_weight(plain.detach().contiguous(), None)
            self._key = key
            self._run_key = None  # ``run`` checks the new weights before it trusts them (``packed`` may pack any)
            self._dtype = weights[0].dtype
            self._splits = [w.shape[0] for w in weights]
        return self._packed

    # A packed (opaque oneDNN) tensor can be neither pickled nor deep-copied; a copy repacks on first use.
    def __getstate__(self) -> dict[str, Any]:
        return {"row_chunk": self.row_chunk}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.row_chunk = state.get("row_chunk")

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        copy = PackedLinear()
        copy.row_chunk = self.row_chunk
        return copy
