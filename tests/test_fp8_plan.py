"""The catalog's FP8 peaks and the refusal of ``fp8`` on GPUs without FP8 tensor cores (issue 31, planner side)."""

from __future__ import annotations

import pytest

from jupyter_dist.errors import PlanInputError
from jupyter_dist.plan.hardware import ACCELERATORS, fp8_problem, get_accelerator


@pytest.mark.parametrize(
    ("name", "tflops_with_sparsity"), [("h100-80gb", 3958), ("h100-pcie", 3026), ("h200", 3958), ("l4", 485)]
)
def test_fp8_peaks_are_half_the_datasheets_sparse_figures(name: str, tflops_with_sparsity: float) -> None:
    acc = get_accelerator(name)
    assert acc.supports_fp8 and fp8_problem(acc) is None
    assert acc.peak_flops("fp8") == pytest.approx(tflops_with_sparsity / 2 * 1e12)
    assert acc.peak_flops("fp8") >= 2 * acc.peak_flops("bf16") * 0.99  # FP8 doubles the bf16 rate on these


@pytest.mark.parametrize("name", ["a100-80gb", "a100-40gb", "v100-32gb", "a10g", "cpu"])
def test_gpus_without_fp8_refuse_it_in_one_line_naming_those_that_have_it(name: str) -> None:
    acc = get_accelerator(name)
    problem = fp8_problem(acc)
    assert problem == (f"precision fp8 needs FP8 tensor cores, which {acc.label} lacks; GPUs with them: "
                       "l4, h100-pcie, h100-80gb, h200")  # fmt: skip
    with pytest.raises(PlanInputError, match=r"^precision fp8 needs FP8 tensor cores") as e:
        acc.peak_flops("fp8")
    assert "\n" not in str(e.value)


def test_other_peaks_unchanged() -> None:
    h100 = ACCELERATORS["h100-80gb"]
    assert (h100.peak_flops("bf16"), h100.peak_flops("fp32")) == (989e12, 67e12)
    assert h100.to_dict()["fp8_flops"] == 1979e12
