"""fp32 products take the kernel timed faster on this host, on the loaded model's own products: per row count for
decodes and verifies, once for every prefill."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from busy_host import busy_host
from packed_models import MEDIUM

import specdec.cpu_wait as cpu_wait
import specdec.nn.fp32_kernels as fp32_kernels
import specdec.nn.packed_linear as packed_linear
from specdec.nn.config import ModelConfig
from specdec.nn.fp32_kernels import (
    ATTEMPTS,
    MARGIN,
    MAX_CPU_WAIT,
    PREFILL_REPEATS,
    KernelTiming,
    choose_fp32_kernels,
    time_kernels,
)
from specdec.nn.packed_linear import (
    FP32_DECODE_ROWS,
    FP32_PREFILL_CHUNK,
    PackedLinear,
    fp32_f_linear_rows,
    fp32_kernel_choice,
    mkldnn_available,
    set_fp32_f_linear_rows,
)
from specdec.nn.transformer import Transformer

pytestmark = [
    pytest.mark.skipif(not mkldnn_available(), reason="this torch build has no oneDNN: nothing is packed"),
    pytest.mark.usefixtures("restore_choice"),  # the choice is process-wide
]


def scripted(f_linear_over_packed: dict[int, float], timed: list[int]):  # type: ignore[no-untyped-def]
    """A ``time_kernels`` stand-in: F.linear takes the given share of the packed time at each row count."""

    def fake(products, rows):  # type: ignore[no-untyped-def]
        timed.append(rows)
        return KernelTiming(rows, 1.0, f_linear_over_packed.get(rows, 2.0))

    return fake


def test_the_row_counts_where_f_linear_wins_are_chosen_and_timing_stops_after_two_losses(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[int] = []
    monkeypatch.setattr(fp32_kernels, "time_kernels", scripted({1: 0.7, 2: 0.75, 3: 0.8, 5: 0.7}, timed))
    timings = choose_fp32_kernels(medium)
    assert timed == [1, 2, 3, 4, 5, 6, 7, P]  # 4 lost, 5 won again, then 6 and 7 lost: stop; then a prefill's
    assert fp32_f_linear_rows() == frozenset({1, 2, 3, 5})
    assert [t.rows for t in timings] == timed


P = FP32_PREFILL_CHUNK


def test_a_prefill_is_timed_on_one_layer_at_its_piece_size_and_its_win_holds_alone(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, list[object]]] = []

    def fake(products, rows):  # type: ignore[no-untyped-def]
        seen.append((rows, [linear for linear, _ in products]))
        return KernelTiming(rows, 1.0, 0.8 if rows == P else 2.0)

    monkeypatch.setattr(fp32_kernels, "time_kernels", fake)
    choose_fp32_kernels(medium)
    assert [rows for rows, _ in seen] == [1, 2, P]
    layer = [linear for linear, _ in medium.decode_products()[:4]]  # the first decoder layer's four products
    assert seen[-1][1] == layer * PREFILL_REPEATS
    assert fp32_f_linear_rows() == frozenset({P})


def test_a_win_inside_the_margin_keeps_the_packed_kernel(medium: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    monkeypatch.setattr(fp32_kernels, "time_kernels", scripted({1: MARGIN + 0.02, 2: MARGIN}, timed))
    choose_fp32_kernels(medium)
    assert fp32_f_linear_rows() == frozenset({2})
    assert timed == [1, 2, 3, 4, P]


def attempts(  # type: ignore[no-untyped-def]
    *waits: float | None, wins: dict[int, float], timed: list[int], prefill_waits: tuple[float, ...] | None = None
):
    """A ``time_kernels`` stand-in whose n-th timing of the row counts ran at the n-th CPU wait share (a prefill's
    at ``prefill_waits``' n-th, where given)."""
    attempt = [-1]

    def fake(products, rows):  # type: ignore[no-untyped-def]
        if rows == 1:
            attempt[0] += 1
        timed.append(rows)
        wait = prefill_waits[attempt[0]] if prefill_waits is not None and rows == P else waits[attempt[0]]
        return KernelTiming(rows, 1.0, wins.get(rows, 2.0), wait)

    return fake


def test_a_timing_on_a_busy_host_is_taken_again_and_the_quiet_one_chooses(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[int] = []
    monkeypatch.setattr(fp32_kernels, "time_kernels", attempts(0.5, MAX_CPU_WAIT, wins={1: 0.7, 2: 0.7}, timed=timed))
    timings = choose_fp32_kernels(medium)
    assert timed == [1, 2, 3, 4, P] * 2  # timed twice; the second, at the limit, counts as quiet
    assert fp32_f_linear_rows() == frozenset({1, 2})
    assert not any(t.busy_host for t in timings)


def test_a_busy_prefill_timing_alone_discards_the_whole_timing(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[int] = []
    fake = attempts(0.0, 0.0, wins={1: 0.5, P: 0.5}, timed=timed, prefill_waits=(0.5, 0.0))
    monkeypatch.setattr(fp32_kernels, "time_kernels", fake)
    timings = choose_fp32_kernels(medium)
    assert timed == [1, 2, 3, P] * 2 and not any(t.busy_host for t in timings)
    assert fp32_f_linear_rows() == frozenset({1, P})
    timed.clear()
    monkeypatch.setattr(
        fp32_kernels, "time_kernels", attempts(0.0, 0.0, wins={1: 0.5}, timed=timed, prefill_waits=(0.5, 0.5))
    )
    choose_fp32_kernels(medium)
    assert fp32_f_linear_rows() == frozenset()  # busy at the prefill's size in every attempt: nothing is taken


def test_a_host_busy_through_every_attempt_keeps_the_packed_path(
    medium: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[int] = []
    waits = [0.5] * ATTEMPTS
    monkeypatch.setattr(fp32_kernels, "time_kernels", attempts(*waits, wins={1: 0.5}, timed=timed))
    set_fp32_f_linear_rows(frozenset({3}))
    timings = choose_fp32_kernels(medium)
    assert timed == [1, 2, 3, P] * ATTEMPTS
    assert fp32_f_linear_rows() == frozenset()  # no win taken from a busy host, none kept from before
    assert all(t.busy_host for t in timings)


def test_an_unknown_cpu_wait_counts_as_quiet(medium: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    monkeypatch.setattr(fp32_kernels, "time_kernels", attempts(None, wins={1: 0.5}, timed=timed))
    choose_fp32_kernels(medium)
    assert timed == [1, 2, 3, P] and fp32_f_linear_rows() == frozenset({1})


@pytest.mark.skipif(cpu_wait.run_queue_wait_s() is None, reason="this OS does not report run-queue waits")
def test_the_real_timing_sees_a_busy_host(medium: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    # The small model's passes take about a millisecond: more of them, so the scheduler has to share the cores
    # (a thread that slept runs ahead of the spinners for a few milliseconds before it waits its turn).
    monkeypatch.setattr(fp32_kernels, "PASSES", 150)
    monkeypatch.setattr(fp32_kernels, "MAX_ROWS", 2)
    set_fp32_f_linear_rows(frozenset({3}))
    with busy_host():
        timings = choose_fp32_kernels(medium)
    assert any(t.busy_host for t in timings), timings  # one busy row count discards the whole timing
    assert fp32_f_linear_rows() == frozenset()


def test_nothing_is_timed_for_bf16_or_a_model_too_small_to_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    monkeypatch.setattr(fp32_kernels, "time_kernels", scripted({1: 0.5}, timed))
    set_fp32_f_linear_rows(frozenset({3}))
    assert choose_fp32_kernels(Transformer(MEDIUM, seed=0, dtype=torch.bfloat16)) == []
    assert choose_fp32_kernels(Transformer(ModelConfig.tiny(), seed=0)) == []
    assert timed == [] and fp32_f_linear_rows() == frozenset({3})


def _sleeping(seconds: float, fn, calls: list[int]):  # type: ignore[no-untyped-def]
    def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("slower", ["f_linear", "packed"])
def test_time_kernels_times_each_kernel_on_every_product(
    medium: Transformer, slower: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    products = medium.decode_products()
    calls: list[int] = []
    if slower == "f_linear":
        monkeypatch.setattr(fp32_kernels, "F", SimpleNamespace(linear=_sleeping(1e-3, F.linear, calls)))
        per_pass = sum(len(ws) for _, ws in products)  # the unfused weights, one F.linear each
    else:
        monkeypatch.setattr(fp32_kernels, "packed_product", _sleeping(1e-3, packed_linear.packed_product, calls))
        per_pass = len(products)  # one packed matrix per product
    timing = time_kernels(products, 2)
    assert len(calls) == (fp32_kernels.PASSES + 1) * per_pass  # every product in every pass, the warm-up included
    slow, fast = (timing.f_linear_s, timing.packed_s) if slower == "f_linear" else (timing.packed_s, timing.f_linear_s)
    assert slow >= per_pass * 1e-3 > fast
    assert timing.rows == 2


def test_decode_products_are_every_linear_of_a_forward(medium: Transformer) -> None:
    products = medium.decode_products()
    assert len(products) == 4 * MEDIUM.num_layers + 1
    layer = medium.model.decoder_layers()[0]
    assert products[0] == (
        layer.self_attn.qkv,
        (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight),
    )
    assert products[-1][0] is medium._lm_head_packed and products[-1][1][0] is medium.lm_head_weight
    weights = {id(w) for _, ws in products for w in ws}
    linear = {id(p) for name, p in medium.named_parameters() if "proj" in name or "lm_head" in name}
    assert linear <= weights
    assert medium.prefill_products() == products[:4]  # a prefill is timed on the first layer's, no LM head


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_run_takes_f_linear_exactly_at_the_chosen_row_counts(rows: int) -> None:
    set_fp32_f_linear_rows(frozenset({1, 3}))
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    linear = PackedLinear()
    got = linear.run(x, (w,))[0]
    if rows in (1, 3):
        assert linear._packed is None and torch.equal(got, F.linear(x, w))
    else:
        assert linear._packed is not None
        torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=0)
    assert PackedLinear.applies(x, (w,))  # the path is still available; the measured choice skips it
    bf16 = PackedLinear()
    bf16.run(x.bfloat16(), (w.bfloat16(),))
    assert bf16._packed is not None or not packed_linear.mkldnn_bf16_available()  # bf16 always packs


def test_a_prefill_takes_the_packed_path_in_pieces_or_f_linear_where_that_won(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g)
    x = torch.randn(2 * P + 3, 256, generator=g)
    sizes: list[int] = []
    real = packed_linear.packed_product
    monkeypatch.setattr(packed_linear, "packed_product", lambda part, m: sizes.append(part.shape[0]) or real(part, m))
    set_fp32_f_linear_rows(frozenset({1}))  # one row on F.linear says nothing about prefills
    linear = PackedLinear()
    got = linear.run(x, (w,))[0]
    assert sizes == [P, P, 3]  # pieces of at most FP32_PREFILL_CHUNK rows
    assert torch.equal(got, torch.cat([real(part, linear.packed((w,))) for part in x.split(P)]))
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=0)
    sizes.clear()
    linear.row_chunk = 32  # a smaller piece (bf16's batch invariance, a drafter's) is kept
    linear.run(x[: P + 1], (w,))
    assert sizes and max(sizes) == 32
    linear.row_chunk = None

    set_fp32_f_linear_rows(frozenset({P}))  # F.linear won at a prefill's size: every prefill takes it
    sizes.clear()
    for rows in (FP32_DECODE_ROWS + 1, P, 2 * P + 3):
        assert torch.equal(linear.run(x[:rows], (w,))[0], F.linear(x[:rows], w))
    assert sizes == []
    linear.run(x[:FP32_DECODE_ROWS], (w,))  # a decode-sized batch keeps the packed path
    assert sizes == [FP32_DECODE_ROWS]


def test_a_bad_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="row counts must be >= 1"):
        set_fp32_f_linear_rows(frozenset({0, 2}))


def test_the_kernel_choice_in_words_is_this_process_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    set_fp32_f_linear_rows(frozenset({2, 1}))
    mine = fp32_kernel_choice()
    assert mine == fp32_kernel_choice([1, 2], onednn=packed_linear.mkldnn_available())
    assert fp32_kernel_choice([2, 1]) == "float32 products of 1, 2 row(s) on `F.linear`, the rest on the packed kernel"
    assert fp32_kernel_choice([]) == "every float32 product on the packed kernel"
    prefill = "of prefills (over 64 rows) on `F.linear`, the rest on the packed kernel"
    assert fp32_kernel_choice([P, 1]) == f"float32 products of 1 row(s) and {prefill}"
    assert fp32_kernel_choice([P]) == f"float32 products {prefill}"
    assert fp32_kernel_choice([1], onednn=False) == "every float32 product on `F.linear` (this torch has no oneDNN)"
    monkeypatch.setattr(packed_linear, "_MKLDNN", False)  # a torch without oneDNN runs no packed product at all
    assert fp32_kernel_choice() == fp32_kernel_choice([], onednn=False)
