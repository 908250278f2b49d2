"""The catalog's FP8 peaks and the refusal of ``fp8`` on GPUs without FP8 tensor cores (issue 31, planner side);
``fp8`` in the planner: the time and memory model, the one-line refusals (Python API, CLI, magic), the candidates
jd.wrap cannot run, the renderer, the wizard's choice and the worker's ``JD_PRECISION=fp8`` without patching."""

from __future__ import annotations

import pytest

from jupyter_dist.errors import PlanInputError
from jupyter_dist.plan import Hardware, TrainingShape, plan
from jupyter_dist.plan.hardware import ACCELERATORS, fp8_problem, get_accelerator
from jupyter_dist.plan.model import get_preset
from jupyter_dist.plan.parallel import ParallelDims
from jupyter_dist.plan.perf import MEMORY_EFFICIENCY, compute_parts
from jupyter_dist.plan.strategies import STRATEGIES, runs_as
from jupyter_dist.plan.training import Precision, fp8_strategy_problem, precision_names
from jupyter_dist.render.common import RenderError, RenderOptions
from jupyter_dist.worker._env import PRECISIONS, WorkerEnv


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


H100 = ACCELERATORS["h100-80gb"]
A100_REFUSAL = (
    "precision fp8 needs FP8 tensor cores, which NVIDIA A100 80GB SXM4 lacks; GPUs with them: l4, h100-pcie, "
    "h100-80gb, h200"
)


def _shape(precision: str, **kw: int) -> TrainingShape:
    return TrainingShape(micro_batch=2, seq_len=2048, precision=precision, **kw)


def test_fp8_is_a_precision_and_a_worker_value_without_patching() -> None:
    assert Precision("fp8") is Precision.FP8 and precision_names()[-1] == "fp8" and "fp8" in PRECISIONS
    assert Precision.FP8.compute_dtype == "bf16" and Precision.FP8.bytes_per_activation == 2
    env = WorkerEnv.from_environ({"JD_PRECISION": "fp8"})
    assert env.precision == "fp8"
    assert TrainingShape(precision="float8").precision is Precision.FP8


def test_fp8_time_term_equals_the_formula_for_one_layer() -> None:
    """One Llama-2-7B block on one H100: the blocks' linears at the FP8 peak, the head at bf16, casts at 3 bytes."""
    model = get_preset("llama-2-7b").with_(layers=1)
    hw = Hardware.from_names("h100-80gb", gpus_per_node=1)
    dims = ParallelDims(dp=1)
    tokens = 2 * 2048
    bf16 = compute_parts(model, _shape("bf16-mixed"), hw, dims, tokens_per_gpu=tokens)
    fp8 = compute_parts(model, _shape("fp8"), hw, dims, tokens_per_gpu=tokens)
    h, f, v = 4096, 11008, 32000
    e = H100.matmul_efficiency * h / (h + 512) * (1 + 512 / 8192)  # the width-scaled rate of perf.matmul_efficiency
    # FP8's half width grows with its peak (the roofline's ridge point at the same memory bandwidth): 512 x 2.0
    half = 512 * H100.fp8_flops / H100.bf16_flops
    e8 = H100.matmul_efficiency * h / (h + half) * (1 + half / 8192)
    linear = 4 * h * h + 3 * h * f  # q, k, v, o (32 kv heads: k, v are h x h) and the gated MLP, no biases
    assert model.attention_params + model.expert_params == linear
    assert H100.fp8_flops == pytest.approx(1979e12) and H100.bf16_flops == pytest.approx(989e12, rel=1e-3)
    expected = 6 * linear * tokens / (H100.fp8_flops * e8) + 6 * v * h * tokens / (H100.bf16_flops * e)
    assert fp8["matmul"] == pytest.approx(expected, rel=1e-12)
    # casts: inputs 3h (q, k, v) + h (o) + 2h (gate, up) + f (down); output gradients 3h + h + 2f + h; the weights
    per_token = (3 * h + h + 2 * h + f) + (3 * h + h + 2 * f + h)
    cast = 3 * (per_token * tokens + linear) / (H100.memory_bw * MEMORY_EFFICIENCY)
    assert fp8["elementwise"] - bf16["elementwise"] == pytest.approx(cast, rel=1e-9)
    assert fp8["attention"] == bf16["attention"]  # the attention core stays in bf16
    assert sum(fp8.values()) < sum(bf16.values())


def test_fp8_is_faster_than_bf16_on_h100_with_the_same_memory() -> None:
    hw = Hardware.from_names("h100-80gb")
    bf16 = plan("llama-2-7b", hw, _shape("bf16-mixed"), strategy="fsdp2")
    fp8 = plan("llama-2-7b", hw, _shape("fp8"), strategy="fsdp2")
    b, f = bf16.candidate("fsdp2"), fp8.candidate("fsdp2")
    assert f.time.step_time_s < b.time.step_time_s
    assert any("(the blocks' linear layers: of the 1,979 TFLOP/s FP8 peak)" in r for r in fp8.reasons)
    assert not any("FP8 peak" in r for r in bf16.reasons)
    # the memory model counts fp8 as bf16-mixed (fp32 masters and states, bf16 activations; memory.py docstring)
    assert f.memory == b.memory
    ddp_b = plan("gpt2", hw, _shape("bf16-mixed"), strategy="ddp").candidate("ddp")
    ddp_f = plan("gpt2", hw, _shape("fp8"), strategy="ddp").candidate("ddp")
    assert ddp_f.memory == ddp_b.memory and ddp_f.time.step_time_s < ddp_b.time.step_time_s


@pytest.mark.parametrize("gpu", ["a100-80gb", "cpu", "v100-32gb", "a10g"])
def test_python_api_refuses_fp8_without_fp8_tensor_cores_in_one_line(gpu: str) -> None:
    with pytest.raises(PlanInputError) as e:
        plan("gpt2", gpu, _shape("fp8"))
    text = str(e.value)
    assert "\n" not in text and text.startswith("precision fp8 needs FP8 tensor cores, which ")
    assert text.endswith("lacks; GPUs with them: l4, h100-pcie, h100-80gb, h200")
    if gpu == "a100-80gb":
        assert text == A100_REFUSAL


def test_cli_refuses_fp8_on_a100_and_cpu_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from jupyter_dist.cli import main

    for gpu in ("a100-80gb", "cpu"):
        assert main(["plan", "--model", "gpt2", "--gpu", gpu, "--precision", "fp8"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "precision fp8 needs FP8 tensor cores" in err[-1]
        assert [line for line in err if "fp8" in line] == [err[-1]]
    assert err[-1].endswith("CPU process (gloo) lacks; GPUs with them: l4, h100-pcie, h100-80gb, h200")
    assert main(["plan", "--model", "gpt2", "--gpu", "h100-80gb", "--precision", "fp8", "--json"]) == 0
    capsys.readouterr()


def test_magic_refuses_fp8_on_a100_in_one_line() -> None:
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_dist")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("dist_plan", "--model gpt2 --gpu a100-80gb --precision fp8")
    assert str(e.value) == A100_REFUSAL
    p = ip.run_line_magic("dist_plan", "--model gpt2 --gpu h100-80gb --precision fp8")
    assert p.training.precision is Precision.FP8 and p.recommended is not None


def test_deepspeed_and_tp_candidates_are_listed_never_recommended_under_fp8() -> None:
    hw = Hardware.from_names("h100-80gb")
    p = plan("llama-2-7b", hw, _shape("fp8"))
    assert p.recommended is not None
    best = p.candidate(p.recommended)
    assert STRATEGIES[best.strategy].family != "deepspeed" and best.dims.tp == 1 and not best.needs
    deepspeed = [c for c in p.candidates if runs_as(STRATEGIES[c.strategy], model_parallel=not
                                                    c.dims.is_data_parallel_only).family == "deepspeed"]  # fmt: skip
    assert {c.strategy for c in deepspeed} >= {"zero1", "zero2", "zero3", "zero2-offload", "zero3-offload-params"}
    assert all(c.needs == fp8_strategy_problem("deepspeed") for c in deepspeed)
    tp = [c for c in p.candidates if c.dims.tp > 1]
    assert tp and all("fp8 with tensor parallelism" in c.needs for c in tp)
    assert any(w.startswith("fp8: ") and "never recommended" in w for w in p.warnings)
    # zero1 with model parallelism runs as FSDP2: only its tp makes it unrunnable
    assert all("DeepSpeed" not in c.needs for c in p.candidates if c.strategy == "zero1" and c.dims.pp > 1
               and c.dims.tp == 1)  # fmt: skip
    # bf16-mixed marks none of them
    assert not any(c.needs for c in plan("llama-2-7b", hw, _shape("bf16-mixed")).candidates)


def test_the_worker_refuses_fp8_under_deepspeed_with_the_planners_reason() -> None:
    torch = pytest.importorskip("torch")
    from jupyter_dist.worker._env import WorkerError
    from jupyter_dist.worker._float8 import convert_float8

    env = WorkerEnv(distributed=False, precision="fp8", fp8_emulate=True)
    model = torch.nn.Linear(16, 16)
    with pytest.raises(WorkerError) as e:
        convert_float8(env, model, [model], torch.device("cpu"), family="deepspeed")
    assert str(e.value) == f"JD_PRECISION={fp8_strategy_problem('deepspeed')}"


def test_the_renderer_refuses_fp8_where_the_worker_does_in_one_line_and_the_bundle_says_so() -> None:
    from jupyter_dist.render.accelerate import FP8_ACCELERATE_REFUSAL, render_accelerate_config
    from jupyter_dist.render.bundle import render_bundle
    from jupyter_dist.render.deepspeed import render_deepspeed
    from jupyter_dist.render.torch_code import render_train_script

    p = plan("gpt2", Hardware.from_names("h100-80gb", gpus_per_node=4), _shape("fp8"))
    assert "convert_float8(model, args)" in render_train_script(p, RenderOptions(candidate="fsdp2"))  # issue 31
    assert "\n" not in FP8_ACCELERATE_REFUSAL
    with pytest.raises(RenderError) as e:
        render_train_script(p, RenderOptions(candidate="zero2"))
    assert str(e.value) == f"candidate zero2: {fp8_strategy_problem('deepspeed')}"
    with pytest.raises(RenderError, match="^precision fp8: no accelerate config"):
        render_accelerate_config(p)
    with pytest.raises(RenderError) as e:
        render_deepspeed(p, RenderOptions(candidate="zero2"))
    assert str(e.value) == fp8_strategy_problem("deepspeed")
    bundle = render_bundle(p)
    assert "train.py" in bundle.files and "accelerate_config.yaml" not in bundle.files
    assert {"plan.json", "launch.sh", "job.sbatch"} <= set(bundle.files)


def test_wizard_offers_fp8_on_h100_and_not_on_a100() -> None:
    from jupyter_dist.ui.wizard_model import precision_choices

    assert precision_choices("h100-80gb") == precision_names()
    assert precision_choices("a100-80gb") == [p for p in precision_names() if p != "fp8"]
    pytest.importorskip("ipywidgets")
    from jupyter_dist.ui.wizard import Wizard

    w = Wizard(model="gpt2", gpu="h100-80gb")
    prec = w.controls["precision"]
    assert "fp8" in prec.options
    prec.value = "fp8"
    assert w.plan is not None and w.plan.training.precision is Precision.FP8
    w.controls["gpu"].value = "a100-80gb"
    assert "fp8" not in prec.options and prec.value == "bf16-mixed"
    assert w.plan is not None and w.plan.training.precision is Precision.BF16_MIXED
    w.controls["gpu"].value = "h100-80gb"
    assert "fp8" in prec.options and prec.value == "bf16-mixed"
