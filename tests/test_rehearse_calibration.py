"""A rehearsal calibrates the plan's memory for the candidate it rehearsed, with consent (issue 33).

``Rehearsal.save_calibration()`` (``%dist_rehearse --save``, ``jupyter-dist rehearse --save``; never by itself)
stores the worst rehearsed rank's step peak minus the planned one as that candidate's entry of
:attr:`~jupyter_dist.plan.calibration.Calibration.memory_by_candidate`, for the plan it was rehearsed for
(:func:`~jupyter_dist.plan.calibration.plan_shape`), in the hardware's calibration file, keeping a tune's speed fit.
Later plans of that shape plan the candidate's peak as rehearsed, exactly, and say so; the other candidates are
unchanged. A rehearsal on another device than the plan's (a CPU rehearsal of an H100 plan) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from jupyter_dist.errors import PlanInputError
from jupyter_dist.launch.measure import planned_peak
from jupyter_dist.launch.rehearse import RankRehearsal, Rehearsal, rehearse
from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan
from jupyter_dist.plan.calibration import Calibration, hardware_key, load_calibration, plan_shape
from jupyter_dist.plan.plan import REHEARSED_MARK

DENSE = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
SHAPE = TrainingShape(micro_batch=2, seq_len=16, precision="fp32")
FLAGS = ("--layers 4 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 128 --gpu cpu --gpus-per-node 4 "
         "--strategy fsdp2 --tp 2 --micro-batch 2 --seq-len 16 --precision fp32").split()  # fmt: skip
"""docs/rehearsal.md's example: a 4-process CPU plan, fsdp2+tp2+sp."""
CANDIDATE = "fsdp2+tp2+sp"
MIB = 2**20


def cpu_plan(world: int = 4, shape: TrainingShape = SHAPE, **kwargs: Any) -> Any:
    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=world, nodes=1)
    return plan(DENSE, hw, shape, **kwargs)


def h100_plan(**kwargs: Any) -> Any:
    hw = Hardware(accelerator=get_accelerator("h100-80gb"), gpus_per_node=8, nodes=1)
    return plan(DENSE, hw, SHAPE, **kwargs)


def shape_of(p: Any) -> str:
    return plan_shape(p.model, p.training, p.hardware, p.assumptions)


def rehearsal_cal(p: Any, entries: dict[str, int], **kwargs: Any) -> Calibration:
    acc = p.hardware.accelerator
    return Calibration(hardware_key=hardware_key(acc.name), accelerator=acc.name,
                       matmul_efficiency=acc.matmul_efficiency, op_overhead_s=acc.op_overhead_s,
                       memory_offset_bytes=kwargs.pop("memory_offset_bytes", 0), trials=kwargs.pop("trials", 0),
                       memory_by_candidate=entries, rehearsed_for={c: shape_of(p) for c in entries},
                       **kwargs)  # fmt: skip


def rank(n: int, peak: int, *, device: str = "cpu", name: str = "", error: str = "") -> RankRehearsal:
    if error:
        return RankRehearsal.from_result(n, {"error": error})
    data: dict[str, Any] = {"params": 1, "grads": 1, "optimizer": 1, "peak": peak, "device": device}
    if device == "cuda":
        data.update(cuda_peak=peak, device_name=name)
    return RankRehearsal.from_result(n, data)


def planned(p: Any, name: str) -> int:
    """The plan's step peak as a rehearsal compares it (no CUDA context or allocator reserve)."""
    return planned_peak(p.candidate(name).memory, "cuda")


# ------------------------------------------------------------------------------------------------------ the planner
def test_a_rehearsed_candidates_peak_is_the_planned_one_plus_its_offset_exactly_and_the_others_are_unchanged() -> None:
    base = cpu_plan()
    names = [c.name for c in base.candidates]
    assert CANDIDATE in names and len(names) > 3
    for offset in (3 * MIB + 17, -(planned(base, CANDIDATE) // 3)):  # above the plan, and well under it
        cal = rehearsal_cal(base, {CANDIDATE: offset})
        used = cpu_plan(calibration=cal)
        mem = used.candidate(CANDIDATE).memory
        assert mem.total == base.candidate(CANDIDATE).memory.total + offset
        assert planned(used, CANDIDATE) == planned(base, CANDIDATE) + offset
        assert mem.detail["calibration"] == offset == mem.detail["rehearsal_correction"]
        assert dict(mem.rows())["rehearsed peak - modelled (calibration)"] == offset
        assert sum(v for _, v in mem.rows()) == mem.total
        for name in names:
            if name != CANDIDATE:
                assert used.candidate(name).memory == base.candidate(name).memory, name
                assert used.candidate(name).time == base.candidate(name).time, name  # no speed was measured
        text = " ".join(used.reasons)
        assert f"Memory of {CANDIDATE} calibrated by a rehearsal" in text and str(cal.path()) in text
        assert "--no-calibration" in text and "by %dist_tune" not in text  # no tune: no speed calibration said
        assert used.hardware.accelerator.calibration == ""
        table = used.to_text(limit=None)  # the table marks the rehearsed total, and says what the mark means
        marked = [ln for ln in table.splitlines() if ln.strip().lstrip("* ").startswith(CANDIDATE + " ")]
        assert len(marked) == 1 and f"{REHEARSED_MARK} " in marked[0] + " ", marked
        assert f"{REHEARSED_MARK} the step peak a rehearsal of this plan measured" in table
        assert "a rehearsal of this plan measured" in used.to_html(limit=None)
        assert REHEARSED_MARK + " " not in base.to_text(limit=None).split("Recommended")[0]


def test_the_offset_is_for_the_plan_it_was_rehearsed_for_and_wins_over_a_tunes_offset_for_that_candidate() -> None:
    base = cpu_plan()
    tuned = rehearsal_cal(base, {CANDIDATE: 5 * MIB}, memory_offset_bytes=7 * MIB, trials=2)
    used = cpu_plan(calibration=tuned)
    assert used.candidate(CANDIDATE).memory.total == base.candidate(CANDIDATE).memory.total + 5 * MIB
    other = next(c.name for c in base.candidates if c.name != CANDIDATE)
    assert used.candidate(other).memory.detail["calibration"] == 7 * MIB  # the tune's offset for the rest
    assert any("by %dist_tune" in r for r in used.reasons)
    longer = TrainingShape(micro_batch=2, seq_len=32, precision="fp32")  # another plan: the entry does not apply
    again = cpu_plan(shape=longer, calibration=tuned)
    assert again.candidate(CANDIDATE).memory.detail["calibration"] == 7 * MIB
    said = [r for r in again.reasons if "is for another plan" in r]
    assert len(said) == 1 and "seq 16" in said[0] and CANDIDATE in said[0]
    assert shape_of(again) != shape_of(base) and shape_of(cpu_plan()) == shape_of(base)


def test_an_old_calibration_file_without_the_new_fields_still_loads(calibration_dir: Path) -> None:
    old = {"hardware_key": hardware_key("cpu"), "accelerator": "cpu", "matmul_efficiency": 0.08,
           "op_overhead_s": 1e-4, "memory_offset_bytes": -5, "comm_scale": 3.0, "trials": 3, "step_error": 0.5,
           "measured_at": 1.0, "source": "runs"}  # fmt: skip
    (calibration_dir / f"{hardware_key('cpu')}.json").write_text(json.dumps(old))
    cal = load_calibration("cpu")
    assert cal is not None and cal.memory_by_candidate == {} == cal.rehearsed_for and cal.trials == 3
    p = cpu_plan(calibration=cal)
    assert all(c.memory.detail.get("calibration") == -5 for c in p.candidates)
    assert not any("rehearsal" in r for r in p.reasons)


def test_calibration_values_are_checked() -> None:
    base = cpu_plan()
    with pytest.raises(PlanInputError, match="measures something"):
        rehearsal_cal(base, {})
    with pytest.raises(PlanInputError, match="which plan"):
        Calibration(hardware_key="cpu-x", accelerator="cpu", matmul_efficiency=0.5, op_overhead_s=0.0,
                    memory_offset_bytes=0, trials=1, memory_by_candidate={"ddp": 1})  # fmt: skip


# ---------------------------------------------------------------------------------------------- the rehearsal's side
def test_save_calibration_makes_the_next_plans_peak_the_rehearsed_one_and_keeps_a_tunes_fit() -> None:
    base = cpu_plan()
    tune = rehearsal_cal(base, {"ddp": 11}, memory_offset_bytes=-3 * MIB, trials=4, source="tune-runs")
    tune.save()
    worst = planned(base, CANDIDATE) + 123_457
    r = Rehearsal(candidate=CANDIDATE, world_size=4, plan=base, ranks=(rank(0, worst - 1000), rank(3, worst)))
    assert r.calibration_problem() is None and r.memory_correction() == 123_457
    assert load_calibration("cpu") == tune  # nothing saved by the rehearsal itself
    assert "not saved as a calibration: --save, or .save_calibration()" in r.to_text()
    path = r.save_calibration()
    assert path == r.calibration_path == str(tune.path()) and f"calibration saved to {path}" in r.to_text()
    saved = load_calibration("cpu")
    assert saved is not None
    assert (saved.trials, saved.matmul_efficiency, saved.memory_offset_bytes, saved.source) == (
        4,
        tune.matmul_efficiency,
        -3 * MIB,
        "tune-runs",
    )  # the tune's fit kept
    assert saved.memory_by_candidate == {"ddp": 11, CANDIDATE: 123_457}
    again = cpu_plan(calibration=saved)
    assert planned(again, CANDIDATE) == worst
    # rehearsing the calibrated plan again replaces the entry (measured against the uncalibrated model)
    r2 = Rehearsal(candidate=CANDIDATE, world_size=4, plan=again, ranks=(rank(0, worst + 10),))
    assert r2.memory_correction() == 123_467
    r2.save_calibration()
    assert planned(cpu_plan(calibration=load_calibration("cpu")), CANDIDATE) == worst + 10
    # a tune saved later keeps the rehearsed entries (it measures speed; the rehearsal measured this candidate)
    replace_fit = rehearsal_cal(base, {"ddp": 11}, trials=2)
    Calibration.from_dict({**replace_fit.to_dict(), "memory_by_candidate": {}, "rehearsed_for": {},
                           "trials": 2}).save()  # fmt: skip
    assert load_calibration("cpu").memory_by_candidate == {"ddp": 11, CANDIDATE: 123_467}  # type: ignore[union-attr]


def test_without_a_saved_calibration_a_rehearsal_saves_only_its_memory() -> None:
    base = cpu_plan()
    r = Rehearsal(candidate=CANDIDATE, world_size=4, plan=base, ranks=(rank(0, planned(base, CANDIDATE) - 99),))
    r.save_calibration()
    cal = load_calibration("cpu")
    assert cal is not None and cal.trials == 0 and cal.memory_by_candidate == {CANDIDATE: -99}
    used = cpu_plan(calibration=cal)
    assert used.hardware.accelerator == base.hardware.accelerator  # the published rates
    assert "no speed measured" in cal.describe()


@pytest.mark.parametrize(("make", "ranks", "words"), [
    (h100_plan, [("cpu", "")], "a rehearsal on cpu cannot calibrate a plan for h100-80gb: its memory is for that "
                               "GPU's CUDA allocator"),
    (h100_plan, [("cuda", "NVIDIA A100-SXM4-80GB")], "a rehearsal on NVIDIA A100-SXM4-80GB cannot calibrate a plan "
                                                     "for h100-80gb"),
    (cpu_plan, [("cuda", "NVIDIA H100 80GB HBM3")], "cannot calibrate a plan for cpu processes"),
    (cpu_plan, [("cpu", ""), ("failed", "")], "rank 1 could not be rehearsed"),
])  # fmt: skip
def test_a_rehearsal_on_another_device_than_the_plans_is_refused_in_one_line(
    make: Any, ranks: list[tuple[str, str]], words: str, calibration_dir: Path
) -> None:
    p = make(strategy="fsdp2")
    rs = tuple(
        rank(i, 1000, device=d, name=n, error="killed" if d == "failed" else "") for i, (d, n) in enumerate(ranks)
    )
    r = Rehearsal(candidate="fsdp2", world_size=p.world_size, plan=p, ranks=rs)
    with pytest.raises(PlanInputError) as e:
        r.save_calibration()
    text = str(e.value)
    assert words in text and "\n" not in text and text.startswith("no calibration from this rehearsal: "), text
    if make is h100_plan and ranks[0][0] == "cpu":
        assert "rehearse on that GPU, or plan with --gpu cpu" in text
    assert "save_calibration" not in r.to_text() and not list(calibration_dir.iterdir())


def test_a_rehearsal_on_the_plans_gpu_calibrates_that_gpu() -> None:
    p = h100_plan(strategy="fsdp2")
    r = Rehearsal(candidate="fsdp2", world_size=8, plan=p, ranks=(rank(0, 5 * MIB, device="cuda",
                                                                        name="NVIDIA H100 80GB HBM3"),))  # fmt: skip
    r.save_calibration()
    cal = load_calibration("h100-80gb")
    assert cal is not None and cal.hardware_key == "h100-80gb" and load_calibration("cpu") is None
    assert planned(h100_plan(strategy="fsdp2", calibration=cal), "fsdp2") == 5 * MIB


# -------------------------------------------------------------------------------------------- --save: CLI and magic
def test_save_through_the_cli_and_the_magic(ip: Any, capsys: pytest.CaptureFixture[str], calibration_dir: Path) -> None:
    from IPython.core.error import UsageError

    from jupyter_dist.cli import main

    device = ["cpu"]

    def fake(p: Any, candidate: Any = None, **kwargs: Any) -> Rehearsal:
        name = candidate or p.recommended
        return Rehearsal(
            candidate=name,
            world_size=p.world_size,
            plan=p,
            ranks=(rank(0, planned(p, name) + 4096, device=device[0], name="NVIDIA H100 80GB HBM3"),),
        )

    line = " ".join(FLAGS)
    with patch("jupyter_dist.launch.rehearse.rehearse", fake):
        assert main(["rehearse", *FLAGS]) == 0  # no --save: nothing saved
        assert "not saved as a calibration" in capsys.readouterr().out and not list(calibration_dir.iterdir())
        assert main(["rehearse", *FLAGS, "--save", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        cal = load_calibration("cpu")
        assert cal is not None and out["calibration_path"] == str(cal.path())
        assert cal.memory_by_candidate == {CANDIDATE: 4096}
        cal.path().unlink()
        r = ip.run_line_magic("dist_rehearse", f"{line} --save --name rr")
        assert ip.user_ns["rr"] is r and r.calibration_path == str(cal.path())
        assert load_calibration("cpu").memory_by_candidate == {CANDIDATE: 4096}  # type: ignore[union-attr]
        h100 = line.replace("--gpu cpu --gpus-per-node 4", "--gpu h100-80gb --gpus-per-node 4")
        device[0] = "cpu"
        assert main(["rehearse", *h100.split(), "--save"]) == 2
        cap = capsys.readouterr()
        assert "Rehearsal of" in cap.out  # the table is still shown
        assert (
            "error: no calibration from this rehearsal: a rehearsal on cpu cannot calibrate a plan for "
            "h100-80gb" in cap.err
        )
        with pytest.raises(UsageError, match="a rehearsal on cpu cannot calibrate a plan for h100-80gb"):
            ip.run_line_magic("dist_rehearse", f"{h100} --save")
    assert load_calibration("h100-80gb") is None
    capsys.readouterr()  # the magic showed the refused rehearsal's table
    # the next plan from the same flags uses the saved entry
    assert main(["plan", *FLAGS, "--json"]) == 0
    from jupyter_dist.plan import Plan

    p = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert p.candidate(CANDIDATE).memory.detail["rehearsal_correction"] == 4096
    assert any(f"Memory of {CANDIDATE} calibrated by a rehearsal" in r for r in p.reasons)


# ------------------------------------------------------------------------------------------------- a real rehearsal
@pytest.mark.slow
def test_a_real_rehearsal_saved_makes_the_next_plans_peak_the_rehearsed_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/rehearsal.md's example rehearsed on this CPU (rank 0 of 4, fsdp2+tp2+sp), saved; the next plan from the
    same flags plans that candidate's step peak as the rehearsed one, to the byte."""
    from jupyter_dist.cli import build_parser
    from jupyter_dist.cli.flags import plan_from_args

    before = plan_from_args(build_parser().parse_args(["plan", *FLAGS]))
    r = rehearse(before, CANDIDATE, workdir=tmp_path / "rehearsal", device="cpu", timeout=600)
    assert r.ok, [(x.rank, x.error) for x in r.ranks]
    rehearsed = max(x.measured_peak for x in r.ranks)
    assert load_calibration("cpu") is None  # nothing saved by itself
    r.save_calibration()
    after = plan_from_args(build_parser().parse_args(["plan", *FLAGS]))
    print(f"planned {planned(before, CANDIDATE)} B before, rehearsed {rehearsed} B, "
          f"planned {planned(after, CANDIDATE)} B after")  # fmt: skip
    assert planned(after, CANDIDATE) == rehearsed != planned(before, CANDIDATE)
    # and the rehearsal of the calibrated plan sets the plan's figure beside it equal
    header, rows = Rehearsal(candidate=CANDIDATE, world_size=4, ranks=r.ranks, plan=after).table()
    peak = {row[0]: row[1:] for row in rows}["step peak (MiB)"]
    assert peak[0] == peak[1], (header, peak)
