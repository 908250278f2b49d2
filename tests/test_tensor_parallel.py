"""Tensor and sequence parallelism composed with FSDP2 on one device mesh, proven by equal math.

Each parallel run (real torchrun processes on gloo/CPU, the JD_* contract the launcher sets) trains the same model on
the same global batches as a single process; its losses and its final parameters, gathered to one rank, must equal
the single-process run's. The worker script is ``tests/numerics/parallel_train.py``; adding a model to these tests is
adding a builder to its ``MODELS`` and a name to ``MODELS`` below.

SGD with momentum is the optimizer of the element-wise checks: it carries rounding differences linearly, so 1e-5
relative on every element is a check that catches a wrong layout (a wrong split, a missing all-reduce, a doubled
gradient) and nothing else. Adam divides each gradient by its own running magnitude, which turns rounding noise in
near-zero gradients into full-size updates; with AdamW the tests compare each tensor's norm-relative error instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_worker import clean_env, run_bounded

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent / "numerics" / "parallel_train.py"
MODELS = ("ref", "llama")
RTOL = 1e-5

pytestmark = pytest.mark.slow


def run(out: Path, model: str, nproc: int | None, timeout: float = 240, **env: str) -> dict:
    """Train with ``nproc`` torchrun processes (``None``: one plain process, no strategy); return the saved result."""
    if nproc is None:
        argv = [sys.executable, str(SCRIPT), str(out), model]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(SCRIPT), str(out), model]  # fmt: skip
    proc = run_bounded(argv, clean_env(**env), timeout, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return torch.load(out, weights_only=False)


def assert_equal_math(ref: dict, got: dict, *, elementwise: bool = True) -> None:
    ref_l, got_l = torch.tensor(ref["losses"]), torch.tensor(got["losses"])
    assert len(got_l) == len(ref_l) == 10
    torch.testing.assert_close(got_l, ref_l, rtol=RTOL, atol=0)
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        have = got["params"][name]
        assert have.shape == want.shape, name
        if elementwise:
            scale = want.abs().max()
            err = (have - want).abs().max() / scale
        else:
            err = (have - want).norm() / want.norm()
        assert err <= RTOL, f"{name}: relative error {err:.2e} > {RTOL:.0e} under mesh {got['mesh']}"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """The single-process reference of every model, with SGD and with AdamW."""
    d = tmp_path_factory.mktemp("single")
    return {
        (m, opt): run(d / f"{m}-{opt}.pt", m, None, EQ_OPT=opt) for m in MODELS for opt in ("sgd", "adamw")
    }  # fmt: skip


CONFIGS = {
    # name: (processes, JD_* degrees)
    "tp2": (2, {"JD_TP": "2"}),
    "tp2-sp": (2, {"JD_TP": "2", "JD_SP": "1"}),
    "dp2xtp2": (4, {"JD_TP": "2"}),
    "dp2xtp2-sp-ac": (4, {"JD_TP": "2", "JD_SP": "1", "JD_AC": "full"}),
    "hsdp2x2": (4, {"JD_DP_REPLICATE": "2"}),
    "hsdp2xtp2-sp-sac": (4, {"JD_DP_REPLICATE": "2", "JD_TP": "2", "JD_SP": "1", "JD_AC": "selective"}),
}
EXPECTED_MESH = {
    "tp2": "dp_shard=1 x tp=2", "tp2-sp": "dp_shard=1 x tp=2", "dp2xtp2": "dp_shard=2 x tp=2",
    "dp2xtp2-sp-ac": "dp_shard=2 x tp=2", "hsdp2x2": "dp_replicate=2 x dp_shard=2",
    "hsdp2xtp2-sp-sac": "dp_replicate=2 x dp_shard=1 x tp=2",
}  # fmt: skip


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", MODELS)
def test_parallel_run_equals_single_process(model: str, config: str, single: dict, tmp_path: Path) -> None:
    nproc, degrees = CONFIGS[config]
    got = run(tmp_path / "out.pt", model, nproc, JD_STRATEGY="fsdp2", EQ_OPT="sgd", **degrees)
    assert got["mesh"] == EXPECTED_MESH[config]
    assert_equal_math(single[(model, "sgd")], got)


@pytest.mark.parametrize("model", MODELS)
def test_adamw_under_dp2_tp2_sp_equals_single_process(model: str, single: dict, tmp_path: Path) -> None:
    got = run(tmp_path / "out.pt", model, 4, JD_STRATEGY="fsdp2", JD_TP="2", JD_SP="1", EQ_OPT="adamw")
    assert_equal_math(single[(model, "adamw")], got, elementwise=False)


def test_the_check_catches_tp_ranks_loading_different_batches(single: dict, tmp_path: Path) -> None:
    """The check can fail: the classic mistake of sharding data by global rank (each tensor-parallel rank sees a
    different batch) runs without an error, but its math differs from the single process."""
    got = run(tmp_path / "out.pt", "ref", 2, JD_STRATEGY="fsdp2", JD_TP="2", EQ_OPT="sgd", EQ_BAD_DATA="1")
    with pytest.raises(AssertionError):
        assert_equal_math(single[("ref", "sgd")], got)
