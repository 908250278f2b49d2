"""Expert parallelism composed with FSDP2 on one device mesh, proven by equal math (issue 19).

The mixture-of-experts reference model (:class:`jupyter_dist.models.MoETransformer`, 8 experts, top-2) is trained by
real torchrun processes on gloo/CPU with ``JD_EP`` (experts split over an ``ep`` dimension borrowed from the
data-parallel ranks, tokens moved by all-to-all) and by one plain process on the same global batches; the losses
(cross-entropy plus the load-balancing loss) and the final parameters, gathered to one rank, must agree to 1e-5
relative. Routing is the same in both: a token's experts depend only on its hidden state, and the load-balancing loss
is computed per sequence, so its value does not depend on how the batch is split. The worker is
``tests/numerics/parallel_train.py`` (model ``moe``); see tests/test_tensor_parallel.py for the tolerance rationale
(SGD element-wise, AdamW norm-relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tensor_parallel import SAVE_AT, SCRIPT, Launches, assert_equal_math, assert_resumed, run_singles

torch = pytest.importorskip("torch")

MOE = {"vocab_size": 128, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "n_experts": 8, "top_k": 2,
       "ffn_dim": 32}  # fmt: skip
"""The dimensions of parallel_train.py's ``moe`` model."""


# ------------------------------------------------------------------------------------------ the model, one process
def test_moe_layer_equals_a_token_by_token_loop_and_its_balance_loss_is_split_invariant() -> None:
    """Each token's output is the renormalised top-k weighted sum of its experts' SwiGLU outputs (checked against a
    plain loop); the per-sequence balance loss of a batch is the mean of its halves'; the batch variant is not."""
    import torch.nn.functional as F

    from jupyter_dist.models import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(**MOE)
    moe = model.layers["0"].moe
    x = torch.randn(3, 5, 64)
    xs = x.reshape(-1, 64)
    probs = torch.softmax(moe.router(xs), -1)
    w, chosen = probs.topk(2)
    w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    want = torch.zeros(15, 64)
    for t in range(15):
        for j in range(2):
            e = int(chosen[t, j])
            want[t] += w[t, j] * ((F.silu(xs[t] @ ex.w1[e]) * (xs[t] @ ex.w3[e])) @ ex.w2[e])
    torch.testing.assert_close(moe(x).reshape(-1, 64), want, rtol=1e-5, atol=1e-6)
    assert int((torch.bincount(chosen.flatten(), minlength=8) > 0).sum()) > 2  # the tokens really spread

    tokens = torch.randint(0, 128, (8, 16))
    model(tokens)
    whole = model.aux_loss()
    model(tokens[:4])
    first = model.aux_loss()
    model(tokens[4:])
    torch.testing.assert_close((first + model.aux_loss()) / 2, whole)
    assert 1.0 < whole.item() < 8.0  # E * sum_e f_e P_e: top_k (2) when balanced, at most E (8) when collapsed
    batch = MoETransformer(**MOE, balance="batch")
    batch.load_state_dict(model.state_dict())
    batch(tokens)
    b_whole = batch.aux_loss()
    batch(tokens[:4])
    b_first = batch.aux_loss()
    batch(tokens[4:])
    assert abs(((b_first + batch.aux_loss()) / 2 - b_whole).item()) > 1e-4


def test_the_planner_sees_the_grouped_experts_exactly() -> None:
    """ModelSpec.from_module reads 8 experts, top-2, the expert width and a gated MLP from the 3-D parameters; its
    parameter count from those dimensions equals the module's (so per-rank figures need no scaling)."""
    from jupyter_dist.models import MoETransformer
    from jupyter_dist.plan import ModelSpec

    spec = ModelSpec.from_module(MoETransformer, **MOE)
    assert (spec.experts, spec.top_k, spec.ffn, spec.gated_mlp, spec.layers) == (8, 2, 32, True, 2)
    with torch.device("meta"):
        n = sum(p.numel() for p in MoETransformer(**MOE).parameters())
    assert spec.params == spec.params_from_dims == n
    assert spec.total_expert_params == 2 * 8 * 3 * 64 * 32


def test_bad_moe_configs_get_one_line_each() -> None:
    from jupyter_dist.models import MoETransformerConfig

    for kwargs, msg in (({"top_k": 9}, "top_k must be an integer in 1..n_experts (8)"),
                        ({"n_experts": 0}, "n_experts must be a positive integer"),
                        ({"balance": "global"}, "balance must be one of sequence, batch")):  # fmt: skip
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            MoETransformerConfig(**kwargs)


# ---------------------------------------------------------------------------------------- equal math, processes
class _Single(dict):
    """The single-process reference runs, made on first use: ``single[model, optimizer]``. The first use trains
    every reference this module reads (the mixture of experts with SGD and AdamW, each Hugging Face model with SGD)
    in one process."""

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where

    def __missing__(self, key: tuple[str, str]) -> dict:
        import importlib.util

        keys = [("moe", "sgd"), ("moe", "adamw")]
        if importlib.util.find_spec("transformers") is not None:
            keys += [(m, "sgd") for m in HF_MODELS]
        if key not in keys:
            keys.append(key)
        got = run_singles(self.where, {f"{m}-{o}": (m, {"EQ_OPT": o}) for m, o in keys})
        self.update({(m, o): got[f"{m}-{o}"] for m, o in keys})
        return self[key]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> _Single:
    """The single-process reference of each model and optimizer."""
    return _Single(tmp_path_factory.mktemp("single_moe"))


CONFIGS = {
    # name: (processes, JD_* degrees, the mesh the workers report)
    "ep2": (2, {"JD_EP": "2"}, "dp_shard=2 (experts: efsdp=1 x ep=2)"),
    "ep2xdp2": (4, {"JD_EP": "2"}, "dp_shard=4 (experts: efsdp=2 x ep=2)"),
    # through jd.train_step, the loop that runs under every plan
    "ep2xdp2-ac-step": (4, {"JD_EP": "2", "JD_AC": "full", "EQ_STEP_FORM": "1"},
                        "dp_shard=4 (experts: efsdp=2 x ep=2)"),
    "tp2xep2-sp": (4, {"JD_EP": "2", "JD_TP": "2", "JD_SP": "1"}, "dp_shard=2 x tp=2 (experts: efsdp=1 x ep=2)"),
    "hsdp2xep2": (4, {"JD_EP": "2", "JD_DP_REPLICATE": "2"}, "dp_replicate=2 x dp_shard=2 (experts: efsdp=1 x ep=2)"),
    # pipelines: each stage sends its layers' balance-loss sum on with the hidden states (the loss_fn adds the mean)
    "pp2": (2, {"JD_PP": "2", "JD_MICROBATCHES": "4"}, "pp=2 x dp_shard=1"),
    "pp2xep2": (4, {"JD_PP": "2", "JD_EP": "2", "JD_MICROBATCHES": "2"},
                "pp=2 x dp_shard=2 (experts: efsdp=1 x ep=2)"),
}  # fmt: skip


MEMORY_CONFIGS = ("ep2xdp2", "tp2xep2-sp")
CKPT_RESUMES = {"dp4": {}, "ep2xdp2": {"JD_EP": "2"}}
TP_CKPT_RESUMES = {"pp2xep2": {"JD_PP": "2", "JD_EP": "2", "JD_MICROBATCHES": "2"}, "ep2xdp2": {"JD_EP": "2"}}
"""Meshes that resume the checkpoint saved under tp2 x ep2 + sp (experts split by ep, attention by tp)."""
HF_MODELS = ("mixtral", "qwen2_moe")
EP_ERRORS = SCRIPT.parent / "ep_errors.py"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """Every equal-math run of this module: one launch of 2 processes, one of 4."""
    import importlib.util

    where = tmp_path_factory.mktemp("launches")
    configs: dict[str, tuple[int, str, dict[str, str]]] = {
        name: (nproc, "moe", {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", **degrees})
        for name, (nproc, degrees, _) in CONFIGS.items()
    }
    if importlib.util.find_spec("transformers") is not None:
        for model in HF_MODELS:
            configs[model] = (4, model, {"JD_STRATEGY": "fsdp2", "JD_EP": "2", "EQ_OPT": "sgd"})
    configs["adamw"] = (4, "moe", {"JD_STRATEGY": "fsdp2", "JD_EP": "2", "EQ_OPT": "adamw"})
    configs["efsdp-divide"] = (4, "moe", {"JD_STRATEGY": "fsdp2", "JD_EP": "2", "EQ_OPT": "sgd",
                                          "EQ_EP_EFSDP_DIVIDE": "1"})  # fmt: skip
    for config in MEMORY_CONFIGS:
        nproc, degrees, _ = CONFIGS[config]
        configs[f"memory-{config}"] = (nproc, "moe", {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_MEASURE": "1",
                                                      "EQ_STEPS": "2", **degrees})  # fmt: skip
    common = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_CKPT": str(where / "ckpt")}
    configs["ckpt-full"] = (4, "moe", {"JD_EP": "2", "EQ_SAVE_AT": str(SAVE_AT), **common})
    for name, degrees in CKPT_RESUMES.items():  # after the save, in the same launch
        configs[f"ckpt-{name}"] = (4, "moe", {"EQ_RESUME": "1", **degrees, **common})
    common = {**common, "EQ_CKPT": str(where / "ckpt-tp")}
    configs["ckpt-tp-full"] = (4, "moe", {"JD_EP": "2", "JD_TP": "2", "JD_SP": "1",
                                         "EQ_SAVE_AT": str(SAVE_AT), **common})  # fmt: skip
    for name, degrees in TP_CKPT_RESUMES.items():
        configs[f"ckpt-tp-{name}"] = (4, "moe", {"EQ_RESUME": "1", **degrees, **common})
    # last in the 2-process launch: ep_errors.py run whole, in a fresh runtime
    configs["ep-errors"] = (2, "moe", {"JD_STRATEGY": "fsdp2", "JD_EP": "2", "EQ_SCRIPT": str(EP_ERRORS)})
    return Launches(where, configs)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_expert_parallel_run_equals_single_process(config: str, single: _Single, launches: Launches) -> None:
    got = launches[config]
    assert got["mesh"] == CONFIGS[config][2]
    assert_equal_math(single["moe", "sgd"], got)


@pytest.mark.slow
@pytest.mark.parametrize("model", HF_MODELS)
def test_hugging_face_moe_under_ep2_dp2_equals_single_process(model: str, single: _Single, launches: Launches) -> None:
    """Real transformers ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (small configs; grouped experts, eager;
    Qwen2-MoE with its gated shared expert): their experts are split by our ExpertParallel (transformers' own
    ``base_model_ep_plan`` assumes every ep rank holds the same tokens and all-reduces expert outputs, which does not
    fit ep ranks borrowed from data parallelism), and their own experts forward runs on the tokens each rank
    receives."""
    pytest.importorskip("transformers")
    got = launches[model]
    assert got["mesh"] == "dp_shard=4 (experts: efsdp=2 x ep=2)"
    assert_equal_math(single[model, "sgd"], got)


@pytest.mark.slow
def test_adamw_under_ep2_dp2_equals_single_process(single: _Single, launches: Launches) -> None:
    assert_equal_math(single["moe", "adamw"], launches["adamw"], elementwise=False)


@pytest.mark.slow
def test_the_check_catches_expert_gradients_averaged_over_efsdp_only(single: _Single, launches: Launches) -> None:
    """The check can fail: FSDP2's default divides an expert's gradient by its own efsdp group (2 ranks), but the
    gradient summed the tokens of all 4 data-parallel ranks (2 through the all-to-all, 2 through the reduce-scatter):
    it runs without an error and comes out twice too large."""
    got = launches["efsdp-divide"]
    with pytest.raises(AssertionError):
        assert_equal_math(single["moe", "sgd"], got)


@pytest.mark.slow
@pytest.mark.parametrize("config", MEMORY_CONFIGS)
def test_per_rank_memory_equals_the_plan_to_the_byte(config: str, launches: Launches) -> None:
    """Parameters, gradients and AdamW states each rank holds equal the planner's per-rank figures exactly.

    fsdp2+ep2 on 4 processes: dense states sharded over dp = 4, experts split 2 ways and sharded over dp / ep = 2
    (so every state is 1/4 per rank). fsdp2+tp2+ep2+sp: attention split over tp, experts over ep, the routers and
    norms whole on both tensor-parallel ranks (the planner used to split the router by tp: 1,024 bytes short).
    """
    from jupyter_dist.models import MoETransformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    nproc, degrees, _ = CONFIGS[config]
    launches[f"memory-{config}"]
    spec = ModelSpec.from_module(MoETransformer, **MOE)
    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=4, nodes=1)
    tp = int(degrees.get("JD_TP", "1"))
    p = plan(spec, hw, TrainingShape(micro_batch=2, seq_len=16, precision="fp32"), strategy="fsdp2", ep=2, tp=tp)
    cand = p.candidate("fsdp2+ep2" if tp == 1 else "fsdp2+tp2+ep2+sp")
    assert (cand.dims.dp, cand.dims.ep, cand.dims.expert_shard_size) == (4 // tp, 2, 2 // tp)
    want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
    if tp == 1:
        assert want["params"] == 4 * spec.params // 4  # fp32, every state 1/4 per rank: nothing left whole
    for rank in range(4):
        got = json.loads(Path(f"{launches.path(f'memory-{config}')}.rank{rank}.json").read_text())
        assert got == want, (rank, got, want)


@pytest.mark.slow
def test_checkpoint_saved_under_ep2_dp2_resumes_under_dp4_without_ep_and_under_ep2_dp2(launches: Launches) -> None:
    """DCP checkpoints of DTensor experts reshard: saved at step 2 under ep2 x dp2, resumed under plain fsdp2 dp4
    (experts whole on each rank's shard) and under ep2 x dp2; the next 2 losses equal the uninterrupted run's."""
    full = launches["ckpt-full"]
    assert (launches.where / "ckpt" / f"step-{SAVE_AT}" / "COMPLETE").exists()
    for name in CKPT_RESUMES:
        assert_resumed(full, launches[f"ckpt-{name}"], name)


@pytest.mark.slow
def test_checkpoint_saved_under_tp2_ep2_resumes_under_pp2_ep2_and_under_ep2_dp2(launches: Launches) -> None:
    """Saved at step 2 under tp2 x ep2 + sp (attention split over tp, experts over ep, routers whole on each tp rank;
    AdamW), resumed under pp2 x ep2 (each stage's experts split over ep) and under ep2 x dp2 (experts sharded over
    efsdp 2): the next 2 losses equal the uninterrupted run's."""
    full = launches["ckpt-tp-full"]
    assert full["mesh"] == "dp_shard=2 x tp=2 (experts: efsdp=1 x ep=2)"
    assert (launches.where / "ckpt-tp" / f"step-{SAVE_AT}" / "COMPLETE").exists()
    meshes = {"pp2xep2": "pp=2 x dp_shard=2 (experts: efsdp=1 x ep=2)",
              "ep2xdp2": "dp_shard=4 (experts: efsdp=2 x ep=2)"}  # fmt: skip
    for name in TP_CKPT_RESUMES:
        resumed = launches[f"ckpt-tp-{name}"]
        assert resumed["mesh"] == meshes[name], name
        assert_resumed(full, resumed, name)


@pytest.mark.slow
def test_wrong_expert_parallel_inputs_get_one_line_each(launches: Launches) -> None:
    """``ep_errors.py`` (each wrong input to ``jd.wrap`` under JD_EP=2), last in the 2-process launch."""
    assert launches["ep-errors"] == {"script": str(EP_ERRORS)}
    out = launches.stdout[2].splitlines()
    lines = {ln.split(":", 1)[0][5:]: ln.split(":", 1)[1] for ln in out if ln.startswith("CASE ")}
    assert "needs a mixture-of-experts model with grouped experts" in lines["dense"], lines
    assert "Transformer has none" in lines["dense"] and "JD_EP=1" in lines["dense"]
    assert "ep=2 does not divide the 3 experts of layers.0.moe.experts" in lines["experts"], lines
    assert "among 3" in lines["experts"]


# --------------------------------------------------------------------------------------------- from the notebook
MOE_CELL = """
import torch
import torch.nn as nn

from jupyter_dist.models import MoETransformer

torch.manual_seed(0)
model = MoETransformer(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, ffn_dim=32)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, opt = jd.wrap(model, opt)
for step in range(12):
    g = torch.Generator().manual_seed(step * jd.dp_size + jd.dp_rank)
    tokens = (torch.randint(0, 64, (8, 1), generator=g) + torch.arange(17)) % 64
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)) + 0.01 * model.aux_loss()
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
print("mesh", jd.mesh.describe())
"""


@pytest.mark.slow
def test_fsdp2_ep2_from_dist_train_plan_runs_on_four_processes(ip, runs) -> None:  # noqa: ANN001
    """The planner's fsdp2+ep2 candidate for the MoE reference, launched with `%%dist_train --plan`, runs its
    experts split over ep=2 inside dp4 on 4 processes; every rank logs and nothing is left behind."""
    from conftest import descendants_gone

    from jupyter_dist.models import MoETransformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    spec = ModelSpec.from_module(MoETransformer, vocab_size=64, dim=64, n_layers=2, n_heads=4, n_experts=4, top_k=2,
                                 ffn_dim=32)  # fmt: skip
    p = plan(spec, Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=4),
             TrainingShape(micro_batch=8, seq_len=16, precision="fp32"), strategy="fsdp2", ep=2)  # fmt: skip
    assert p.recommended == "fsdp2+ep2"
    ip.user_ns["ep_plan_p"] = p
    run = ip.run_cell_magic("dist_train", "--plan ep_plan_p --nproc 4 --name ep_magic --timeout 240", MOE_CELL)
    assert run.wait(240) == "succeeded", run.logs()
    env = json.loads((run.dir / "run.json").read_text())["env"]
    assert (env["JD_STRATEGY"], env["JD_EP"]) == ("fsdp2", "2")
    assert "mesh dp_shard=4 (experts: efsdp=2 x ep=2)" in run.logs()
    steps = run.records("step")
    assert {r["rank"] for r in steps} == {0, 1, 2, 3}
    assert descendants_gone(run)
