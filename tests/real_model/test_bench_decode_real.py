"""``specdec bench-decode`` on the cached SmolLM2: its figures say which float32 kernel they ran on."""

from __future__ import annotations

from real_models import SMOLLM2, PulledModel, smollm2  # noqa: F401  (fixture)

from specdec.bench.decode import format_report, measure
from specdec.nn.packed_linear import fp32_kernel_choice


def test_the_report_names_the_float32_kernel_choice_and_only_for_float32(smollm2: PulledModel) -> None:  # noqa: F811
    quick = {"new_tokens": 3, "repeats": 1, "verify_lens": (1, 2), "reference": "none", "log": lambda _: None}
    f32 = measure(SMOLLM2, dtypes=("float32",), **quick)  # type: ignore[arg-type]
    assert f32.fp32_kernels == fp32_kernel_choice() and f32.as_dict()["fp32_kernels"] == f32.fp32_kernels
    first = format_report(f32).splitlines()[0]
    assert first.endswith(f"after; engine float32: {fp32_kernel_choice()}")
    bf16 = measure(SMOLLM2, dtypes=("bfloat16",), **quick)  # type: ignore[arg-type]
    assert bf16.fp32_kernels == "" and format_report(bf16).splitlines()[0].endswith(" after")
