"""Context parallelism (ring attention over the mesh's cp dimension) composed with FSDP2 and TP, by equal math.

Each parallel run (real torchrun processes on gloo/CPU) trains the reference transformer on the same global batches
as a single process; the ranks of one cp group load the same batch (``jd.dp_rank`` counts data-parallel ranks only)
and keep their load-balanced chunks of the sequence (``jd.cp_shard``). Losses and final parameters gathered to one
rank must equal the single-process run's (fp32, 1e-5 relative). The attention is PyTorch's own
``_templated_ring_attention`` (with the CPU flash kernel routed into its dispatcher, see
``jupyter_dist/worker/_context.py``); the checks that it can fail: rotary angles computed from the local chunk (the
classic context-parallel mistake) run without an error and are caught.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tensor_parallel import SAVE_AT, SCRIPT, Launches, assert_equal_math, assert_resumed, run_singles

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The single-process reference, with SGD and with AdamW."""
    refs = {opt: ("ref", {"EQ_OPT": opt}) for opt in ("sgd", "adamw")}
    refs["llama"] = ("llama", {"EQ_OPT": "sgd"})
    return run_singles(tmp_path_factory.mktemp("single"), refs)  # in one process


CONFIGS = {
    # name: (processes, JD_* degrees, the mesh the run must report)
    "cp2": (2, {"JD_CP": "2"}, "dp_shard=1 x cp=2"),
    "cp4": (4, {"JD_CP": "4"}, "dp_shard=1 x cp=4"),
    "dp2xcp2": (4, {"JD_CP": "2"}, "dp_shard=2 x cp=2"),
    "cp2xtp2-sp": (4, {"JD_CP": "2", "JD_TP": "2", "JD_SP": "1"}, "dp_shard=1 x cp=2 x tp=2"),
    "hsdp2xcp2-ac": (4, {"JD_CP": "2", "JD_DP_REPLICATE": "2", "JD_AC": "full"}, "dp_replicate=2 x dp_shard=1 x cp=2"),
    # through jd.train_step (it keeps this rank's chunks, accumulates 2 micro-batches, returns the mean over cp)
    "cp2-step-mb2": (2, {"JD_CP": "2", "JD_MICROBATCHES": "2", "EQ_STEP_FORM": "1"}, "dp_shard=1 x cp=2"),
    # pipeline x context parallelism: each stage gets this rank's positions, the loss is the mean over cp
    "pp2xcp2": (4, {"JD_PP": "2", "JD_CP": "2", "JD_MICROBATCHES": "2"}, "pp=2 x dp_shard=1 x cp=2"),
}  # fmt: skip


CKPT_RESUMES = {"dp4": {}, "pp2xcp2": {"JD_PP": "2", "JD_CP": "2", "JD_MICROBATCHES": "2"}}
HF_CONFIGS = {  # a real Hugging Face LlamaForCausalLM: its attention through transformers' AttentionInterface
    "hf-dp2xcp2": (4, {"JD_CP": "2"}, "dp_shard=2 x cp=2"),
    "hf-pp2xcp2": (4, {"JD_PP": "2", "JD_CP": "2", "JD_MICROBATCHES": "2"}, "pp=2 x dp_shard=1 x cp=2"),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    """Every equal-math run of this module: one launch of 2 processes, one of 4."""
    where = tmp_path_factory.mktemp("launches")
    configs: dict[str, tuple[int, str, dict[str, str]]] = {
        name: (nproc, "ref", {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", **degrees})
        for name, (nproc, degrees, _) in CONFIGS.items()
    }
    configs["adamw"] = (4, "ref", {"JD_STRATEGY": "fsdp2", "JD_CP": "2", "EQ_OPT": "adamw"})
    configs["bad-positions"] = (2, "ref", {"JD_STRATEGY": "fsdp2", "JD_CP": "2", "EQ_OPT": "sgd",
                                           "EQ_BAD_POSITIONS": "1"})  # fmt: skip
    configs["memory"] = (4, "ref", {"JD_STRATEGY": "fsdp2", "JD_CP": "2", "EQ_OPT": "adamw", "EQ_MEASURE": "1",
                                    "EQ_STEPS": "2"})  # fmt: skip
    common = {"JD_STRATEGY": "fsdp2", "EQ_OPT": "adamw", "EQ_CKPT": str(where / "ckpt")}
    configs["ckpt-full"] = (4, "ref", {"JD_CP": "2", "EQ_SAVE_AT": str(SAVE_AT), **common})
    for name, degrees in CKPT_RESUMES.items():  # after the save, in the same launch
        configs[f"ckpt-{name}"] = (4, "ref", {"EQ_RESUME": "1", **degrees, **common})
    for name, (nproc, degrees, _) in HF_CONFIGS.items():
        configs[name] = (nproc, "llama", {"JD_STRATEGY": "fsdp2", "EQ_OPT": "sgd", **degrees})
    # last in their launches: the checks around the attention (cp_checks.py run whole) and a refused strategy
    checks = str(SCRIPT.parent / "cp_checks.py")
    configs["cp-checks"] = (4, "ref", {"JD_STRATEGY": "fsdp2", "JD_CP": "2", "EQ_SCRIPT": checks})
    configs["refuse-ddp"] = (2, "ref", {"JD_STRATEGY": "ddp", "JD_CP": "2", "EQ_STEPS": "1", "EQ_REFUSE": "1"})
    return Launches(where, configs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_context_parallel_run_equals_single_process(config: str, single: dict, launches: Launches) -> None:
    got = launches[config]
    assert got["mesh"] == CONFIGS[config][2]
    assert_equal_math(single["sgd"], got)


@pytest.mark.parametrize("config", list(HF_CONFIGS))
def test_context_parallel_hugging_face_llama_equals_single_process(config: str, single: dict,
                                                                   launches: Launches) -> None:  # fmt: skip
    """``LlamaForCausalLM`` (sdpa) under dp2 x cp2 and pp2 x cp2: each rank's ``position_ids`` are its head-tail
    chunks' places in the sequence (rotary angles), and its attention is PyTorch's ring attention, registered in
    transformers' ``AttentionInterface``; losses and parameters equal one process."""
    got = launches[config]
    assert got["mesh"] == HF_CONFIGS[config][2]
    assert_equal_math(single["llama"], got)


def test_adamw_under_dp2_cp2_equals_single_process(single: dict, launches: Launches) -> None:
    assert_equal_math(single["adamw"], launches["adamw"], elementwise=False)


def test_checkpoint_saved_under_dp2_cp2_resumes_under_dp4_and_under_pp2_cp2(launches: Launches) -> None:
    """DCP checkpoints under context parallelism hold the whole model's states (sharded over dp x cp): saved at step 2
    under dp2 x cp2 (AdamW), resumed under plain dp4 and under pp2 x cp2, the next 2 losses equal the uninterrupted
    run's."""
    full = launches["ckpt-full"]
    assert full["mesh"] == "dp_shard=2 x cp=2" and (launches.where / "ckpt" / f"step-{SAVE_AT}" / "COMPLETE").exists()
    for name in CKPT_RESUMES:
        assert_resumed(full, launches[f"ckpt-{name}"], name)


def test_the_check_catches_rotary_angles_from_the_local_chunk(single: dict, launches: Launches) -> None:
    """The check can fail: positions 0..chunk-1 on every rank (what the model computed before it took positions)
    run without an error, but the math differs from the single process."""
    got = launches["bad-positions"]
    with pytest.raises(AssertionError):
        assert_equal_math(single["sgd"], got)


def test_per_rank_memory_equals_the_plan_to_the_byte(launches: Launches) -> None:
    """Under dp2 x cp2, parameters, gradients and AdamW states are sharded over dp x cp = 4, as the planner's
    fsdp2+cp2 candidate says, to the byte on every rank."""
    from jupyter_dist.models import Transformer
    from jupyter_dist.plan import Hardware, ModelSpec, TrainingShape, get_accelerator, plan

    launches["memory"]
    spec = ModelSpec.from_module(Transformer, vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    hw = Hardware(accelerator=get_accelerator("cpu"), gpus_per_node=4)
    p = plan(spec, hw, TrainingShape(micro_batch=4, seq_len=16, precision="fp32"), strategy="fsdp2", cp=2)
    cand = p.candidate("fsdp2+cp2")
    assert cand.dims.shard_size == 4
    want = {"params": cand.memory.params, "grads": cand.memory.grads, "optimizer": cand.memory.optimizer}
    whole = sum(t.numel() * 4 for t in Transformer(vocab_size=128, dim=64, n_layers=2, n_heads=4,
                                                    n_kv_heads=2).parameters())  # fmt: skip
    assert want["params"] == whole // 4
    for rank in range(4):
        got = json.loads(Path(f"{launches.path('memory')}.rank{rank}.json").read_text())
        assert got == want, (rank, got, want)


def test_everything_around_the_attention_and_one_line_errors(launches: Launches) -> None:
    """dp2 x cp2: dp_rank counts dp only, each rank's head-tail chunks and positions, cp_unshard(cp_shard(x)) == x,
    and one line for each wrong input (before wrap, a model without attention cores, a length that does not split,
    unequal lengths, nothing given). ``cp_checks.py`` runs whole, last in the 4-process launch, in a fresh runtime."""
    assert launches["cp-checks"] == {"script": str(SCRIPT.parent / "cp_checks.py")}
    out = launches.stdout[4].splitlines()
    lines = {ln.split(":", 1)[0][5:]: ln.split(":", 1)[1] for ln in out if ln.startswith("CASE ")}
    assert "call jd.wrap(model, optimizer) first" in lines["before-wrap"]
    assert "runs Hugging Face decoders of type llama, mistral" in lines["hf-model"]
    assert "Gemma2ForCausalLM is 'gemma2'" in lines["hf-model"]
    assert "Qwen2ForCausalLM has sliding-window layers" in lines["hf-sliding"]
    assert "sequence length 14 is not a multiple of 2 x cp (4)" in lines["odd-length"]
    assert "same sequence length on dim 1 (8); got shape (2, 16)" in lines["lengths-differ"]
    assert "give at least one tensor" in lines["nothing"]
    checks = {ln for ln in out if ln.startswith("CHECK ")}
    names = ("dp-rank", "chunks", "positions", "round-trip", "blocking-ring")
    assert checks == {f"CHECK {c}: ok" for c in names}, checks


def test_context_parallel_with_a_strategy_other_than_fsdp2_is_one_line(launches: Launches) -> None:
    """JD_STRATEGY=ddp with JD_CP=2 is refused in jd.wrap (last in the 2-process launch, every rank refusing)."""
    refused = launches["refuse-ddp"]["refused"]
    assert refused is not None, "ddp with cp2 trained instead of being refused"
    assert refused.startswith("WorkerError: "), refused
    assert "context parallelism (cp2) needs JD_STRATEGY=fsdp2 or fsdp2-hybrid" in refused, refused
    assert "\n" not in refused, refused


# ------------------------------------------------------------------------------------------ no processes
def test_head_tail_order_is_pytorchs_load_balancer() -> None:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from jupyter_dist.worker import WorkerError
    from jupyter_dist.worker._context import head_tail_order

    assert head_tail_order(8, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    for seq, cp in ((16, 2), (16, 4), (24, 3), (64, 8)):
        order = torch.tensor(sum(head_tail_order(seq, cp), []))
        assert torch.equal(_HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0], order), (seq, cp)
        causal_work = [sum(p + 1 for p in chunk) for chunk in head_tail_order(seq, cp)]
        assert len(set(causal_work)) == 1  # every rank attends over the same number of (query, key) pairs
    with pytest.raises(WorkerError, match=r"sequence length 10 is not a multiple of 2 x cp \(4\)"):
        head_tail_order(10, 2)


def test_reference_model_positions_default_to_the_sequence_and_change_the_math() -> None:
    from jupyter_dist.models import Transformer

    torch.manual_seed(0)
    m = Transformer(vocab_size=32, dim=32, n_heads=4, n_layers=1)
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        for lin in (m.layers["0"].attention.wq, m.layers["0"].attention.wk):
            lin.weight.mul_(30)  # sharp attention, so positions matter visibly
        plain = m(tokens)
        torch.testing.assert_close(m(tokens, positions=torch.arange(8)), plain, rtol=0, atol=0)
        # rotary attention depends only on relative positions: shifting all positions keeps the logits
        torch.testing.assert_close(m(tokens, positions=torch.arange(8) + 5), plain, rtol=1e-4, atol=1e-5)
        # wrong positions (what a cp rank would use if the model numbered its own chunk) change the logits
        assert not torch.allclose(m(tokens, positions=torch.arange(8).flip(0)), plain, atol=1e-3)
    assert len(m.cp_cores()) == 1 and not list(m.cp_cores()[0].parameters())
