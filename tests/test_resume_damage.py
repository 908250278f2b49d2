"""Collective-safe resume (issue 29): every kind of damage to every file of a checkpoint, on each rank.

Before, a truncated ``extra-rank1.pt`` made rank 1 raise while rank 0 was inside DCP's ``gather_object``: both ranks
stuck. Now every rank checks what it will read and the ranks agree before any collective load, so a checkpoint
damaged on any rank is skipped by all of them. The fast test runs the matrix in this process (one rank); the slow
one in ONE 2-process torchrun launch (gloo, FSDP2: each rank writes its own DCP shard), where each rank resumes from
its own copy of the checkpoints and only the copies of the damaged rank(s) are damaged, so "damaged on rank 1 only"
is exercised for every file, shared ones included.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from test_worker import explain, tiny_env, torchrun

from jupyter_dist.worker import Runtime, WorkerError

KINDS = ("truncated", "zero", "missing", "garbage")


def damage(path: Path, kind: str) -> None:
    """Truncate to half, empty, delete, or overwrite with as many random bytes (seeded: reproducible)."""
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "zero":
        path.write_bytes(b"")
    elif kind == "missing":
        path.unlink()
    elif kind == "garbage":
        path.write_bytes(random.Random(len(data)).randbytes(len(data)))
    else:
        raise ValueError(f"unknown damage {kind!r}; valid: {', '.join(KINDS)}")


# --------------------------------------------------------------------------- one process
def test_each_damage_to_each_file_falls_back_to_the_previous_checkpoint_in_one_process(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    rt = Runtime(tiny_env(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved = {}
    for step in (1, 2):
        rt.backward(model(torch.randn(4, 3)).square().mean())
        rt.step(opt)
        rt.save({"model": model, "optimizer": opt, "epoch": step * 10}, step, root=tmp_path / "base")
        saved[step] = [p.detach().clone() for p in model.parameters()]
    files = ("COMPLETE", "dcp/.metadata", "dcp/__0_0.distcp", "extra-rank0.pt")
    assert all((tmp_path / "base" / "step-2" / f).is_file() for f in files)
    for file in files:
        for kind in KINDS:
            root = tmp_path / "cases" / f"{file.replace('/', '_')}-{kind}"
            shutil.copytree(tmp_path / "base", root)
            damage(root / "step-2" / file, kind)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            if file == "COMPLETE" and kind == "missing":  # not a complete checkpoint: passed over (said in the log)
                got = rt.resume({"model": model, "optimizer": opt}, root=root)
            else:
                with pytest.warns(RuntimeWarning) as caught:
                    got = rt.resume({"model": model, "optimizer": opt}, root=root)
                (message,) = [str(w.message) for w in caught]
                assert f"step-2 could not be loaded on every rank (rank 0: {file}" in message, (file, kind, message)
                assert message.endswith("trying the previous one")
            assert got is not None and got[1] == 1 and got[0]["epoch"] == 10, (file, kind)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved[1], strict=True)), (file, kind)
    # damaged in both: the documented one-line error
    root = tmp_path / "cases" / "both"
    shutil.copytree(tmp_path / "base", root)
    for step in (1, 2):
        damage(root / f"step-{step}" / "extra-rank0.pt", "truncated")
    with pytest.warns(RuntimeWarning), pytest.raises(WorkerError) as err:
        rt.resume({"model": model, "optimizer": opt}, root=root)
    assert str(err.value) == f"jd.resume: none of the 2 checkpoint(s) under {root} could be loaded"
    rt.emitter.close()


def test_a_marker_of_another_step_or_a_missing_extra_file_of_a_saving_rank_is_damage(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    rt = Runtime(tiny_env(tmp_path))
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        rt.save({"model": model}, step)
    marker = tmp_path / "checkpoints" / "step-2" / "COMPLETE"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "step": 7}))
    with pytest.warns(RuntimeWarning, match=r"rank 0: COMPLETE says step 7 in the directory of step 2\)"):
        assert rt.resume({"model": model})[1] == 1  # type: ignore[index]
    marker.write_text(json.dumps([1, 2]))
    with pytest.warns(RuntimeWarning, match="rank 0: COMPLETE holds list, not the JSON object jd.save writes"):
        assert rt.resume({"model": model})[1] == 1  # type: ignore[index]
    rt.emitter.close()


# --------------------------------------------------------------------------- two processes
MATRIX = r"""
import json, os, random, shutil, sys, warnings
from pathlib import Path

import torch
import torch.nn as nn

import jupyter_dist.worker as jd
from jupyter_dist.worker import WorkerError

WORK = Path(os.environ["TEST_WORK"])
KINDS = ("truncated", "zero", "missing", "garbage")
FILES = ("COMPLETE", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "extra-rank0.pt", "extra-rank1.pt")


def damage(path, kind):
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "zero":
        path.write_bytes(b"")
    elif kind == "missing":
        path.unlink()
    else:
        path.write_bytes(random.Random(len(data)).randbytes(len(data)))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
model, opt = jd.wrap(model, opt)


def flat():
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for _, p in sorted(model.named_parameters())]
    return torch.cat([p.detach().reshape(-1).float() for p in ps]).tolist()


saved = {}
for step in (1, 2):
    jd.backward(model(torch.randn(4, 8)).square().mean())
    jd.step()
    jd.save({"model": model, "optimizer": opt, "epoch": step * 10}, step, root=WORK / "base")
    saved[step] = flat()

cases = [("intact", None, None, (), ("step-2",))]
cases += [(f"{f}-{k}-on-{w}", f, k, t, ("step-2",)) for f in FILES for k in KINDS
          for w, t in (("0", (0,)), ("1", (1,)), ("both", (0, 1)))]
cases += [(f"{f}-{k}-on-{w}-both-steps", f, k, t, ("step-1", "step-2"))
          for f, k, w, t in (("extra-rank1.pt", "truncated", "1", (1,)), ("dcp/.metadata", "garbage", "0", (0,)),
                             ("dcp/__1_0.distcp", "missing", "both", (0, 1)), ("COMPLETE", "missing", "0", (0,)),
                             ("COMPLETE", "zero", "1", (1,)))]
progress = open(WORK / f"progress-rank{jd.rank}.txt", "w", buffering=1)
results = {}
for name, file, kind, targets, steps in cases:
    progress.write(f"{name}\n")
    root = WORK / "cases" / name / f"rank{jd.rank}"  # this rank's own copy
    shutil.copytree(WORK / "base", root)
    if jd.rank in targets:
        for s in steps:
            damage(root / s / file, kind)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    out = {"file": file, "kind": kind, "targets": list(targets), "steps": list(steps)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = jd.resume({"model": model, "optimizer": opt}, root=root)
            out.update(step=got and got[1], epoch=got and got[0]["epoch"])
        except WorkerError as exc:
            out.update(error=str(exc).replace(str(root), "ROOT"))
    now = flat()
    out["weights_of"] = next((s for s, w in saved.items() if w == now), "zero" if not any(now) else "other")
    out["warnings"] = [str(w.message).replace(str(root), "ROOT") for w in caught if "jd.resume" in str(w.message)]
    results[name] = out
progress.write("done\n")
(WORK / f"result-rank{jd.rank}.json").write_text(json.dumps(results))
"""

SHARED = ("COMPLETE", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp")


@pytest.mark.slow
def test_each_damage_to_each_file_on_each_rank_of_two_processes_is_skipped_together_without_hanging(
    tmp_path: Path,
) -> None:
    script = tmp_path / "matrix.py"
    script.write_text(MATRIX)
    run_dir, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    try:
        proc = torchrun(script, run_dir, timeout=240, JD_STRATEGY="fsdp2", TEST_WORK=str(work))
    except pytest.fail.Exception as exc:  # a hang: name the case each rank was in
        where = {p.name: p.read_text().splitlines()[-1:] for p in work.glob("progress-rank*.txt")}
        pytest.fail(f"{exc}\ncase each rank was in: {where}")
    assert proc.returncode == 0, explain(proc, run_dir)
    base = work / "base" / "step-2"
    assert all((base / f).stat().st_size > 0 for f in (*SHARED, "extra-rank0.pt", "extra-rank1.pt"))
    res = [json.loads((work / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    assert res[0].keys() == res[1].keys() and len(res[0]) == 1 + 6 * 4 * 3 + 5
    for name in res[0]:
        got = [res[r][name] for r in (0, 1)]
        file, kind, targets, both_steps = got[0]["file"], got[0]["kind"], got[0]["targets"], len(got[0]["steps"]) == 2
        for g in got:
            del g["file"], g["kind"], g["targets"], g["steps"]
        if name == "intact":
            assert all(g == {"step": 2, "epoch": 20, "weights_of": 2, "warnings": []} for g in got), got
            continue
        if file == "COMPLETE" and kind == "missing" and 0 in targets:
            # rank 0 lists the checkpoints: one without its marker is not complete, passed over (said in its log)
            want = (
                {"step": None, "epoch": None, "weights_of": "zero"}
                if both_steps
                else {"step": 1, "epoch": 10, "weights_of": 1}
            )
            assert all({k: g[k] for k in want} == want and not g["warnings"] for g in got), (name, got)
            continue
        if file.startswith("extra-rank") and int(file[len("extra-rank")]) not in targets:
            # only its own rank reads a rank's extra file: damage to another rank's copy of it is never read
            assert all(g == {"step": 2, "epoch": 20, "weights_of": 2, "warnings": []} for g in got), (name, got)
            continue
        finders = targets if file in SHARED else [int(file[len("extra-rank")])]
        for r, g in enumerate(got):
            for step in ("step-2", "step-1") if both_steps else ("step-2",):
                (w,) = [w for w in g["warnings"] if f"ROOT/{step} could not be loaded on every rank (" in w]
                # every rank names each damaged rank and its file (not "failed on another rank"), and no other rank
                assert all(f"rank {k}: {file} " in w for k in finders), (name, r, w)
                assert all(f"rank {k}:" not in w for k in {0, 1} - set(finders)), (name, r, w)
            if both_steps:
                assert g.get("error") == "jd.resume: none of the 2 checkpoint(s) under ROOT could be loaded", (name, g)
                assert g["weights_of"] == "zero", (name, g)
            else:
                assert (g["step"], g["epoch"], g["weights_of"], len(g["warnings"])) == (1, 10, 1, 1), (name, r, g)
    # each rank's log says which checkpoint was loaded and why the newer one was skipped
    for r in (0, 1):
        log = (run_dir / "logs" / f"rank-{r}.log").read_text()
        assert "(step 1) after skipping step-2 (rank 1: extra-rank1.pt cannot be loaded (" in log
    assert "has no COMPLETE marker" in (run_dir / "logs" / "rank-0.log").read_text()
