"""Equal-math worker: train a model a few steps under whatever JD_* degrees it is launched with; save losses and
the final full parameters (gathered) from rank 0.

Run whole (``python parallel_train.py OUT MODEL``, one process, no jd strategy) for the reference, or under
``torchrun --nproc-per-node N`` with ``JD_STRATEGY=fsdp2 JD_TP=2 JD_SP=1 ...`` for a parallel run, or
``parallel_train.py --many SPEC.json`` under torchrun: several configurations (``[{"out", "model", "env"}]``, each
``env`` on top of the launch's) trained in sequence in one launch, each from a fresh runtime (its own mesh) on the
same process group -- what the tests do to pay torchrun's start once per world size (and, run whole with
``--many``, the one-process references one after the other in one process). Every run sees the
same global batch each step: rank ``r`` takes the ``jd.dp_rank``-th of ``jd.dp_size`` equal slices. Adding a model
to the equal-math tests = adding a builder to ``MODELS``.

Environment: ``EQ_STEPS`` (5), ``EQ_BATCH`` (global batch, 8), ``EQ_SEQ`` (16), ``EQ_SAVE_AT``/``EQ_RESUME``
(checkpoint at a step / resume from the newest checkpoint in ``EQ_CKPT``), ``EQ_META=1`` (build on the meta device),
``EQ_BAD_POSITIONS=1`` (under cp: rotary angles from the local chunk, a mistake the equal-math check must catch),
``EQ_PRETRAINED=DIR`` (load weights from a save_pretrained folder), ``EQ_EP_EFSDP_DIVIDE=1`` (a deliberate mistake:
divide expert gradients by the efsdp group only), ``EQ_SYNC_EVERY_MICROBATCH=1`` (a deliberate mistake: the
wrapped model's ``no_sync`` / ``set_requires_gradient_sync`` made no-ops, so every micro-batch reduces its gradients;
the math stays equal, only the reduction count shows it), ``EQ_STEP_FORM=1`` (train through ``jd.train_step``;
always under pp), ``EQ_COUNT_COMM=1`` (save each step's collectives by name, counted by the runtime's comm stats,
which need ``JD_RUN_DIR``). A model with an ``aux_loss()`` (mixture of experts) adds ``AUX_COEF`` times it to the
loss. Besides ``JD_STRATEGY=fsdp2`` and its degrees, ``ddp`` and the DeepSpeed ``zero*`` strategies run too
(``JD_DS_CONFIG``). In ``--many`` only: ``EQ_REFUSE=1`` (the configuration must be refused: its result is
``{"refused": "ErrorType: message"}``, or ``{"refused": None}`` if it trained; put it last in its launch) and
``EQ_SCRIPT=PATH`` (run that check script whole in the configuration's fresh runtime, its lines on the launch's
output; the result is ``{"script": PATH}``).
"""

from __future__ import annotations

# first, as %%dist_train's preamble does: a rank imports torch outside the collector (a faster start)
import jupyter_dist.worker as jd

# isort: split
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 128


def ref_model() -> torch.nn.Module:
    from jupyter_dist.models import Transformer

    return Transformer(
        vocab_size=VOCAB, dim=64, n_layers=int(os.environ.get("EQ_LAYERS", "2")), n_heads=4, n_kv_heads=2
    )


def llama_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=int(os.environ.get("EQ_LAYERS", "2")),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def moe_model() -> torch.nn.Module:
    from jupyter_dist.models import MoETransformer

    return MoETransformer(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2,
                          ffn_dim=32)  # fmt: skip


def mixtral_model() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=int(os.environ.get("EQ_LAYERS", "2")),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        experts_implementation="eager",
    )
    return MixtralForCausalLM(cfg)


def qwen2_moe_model() -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=int(os.environ.get("EQ_LAYERS", "2")),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        experts_implementation="eager",
    )
    return Qwen2MoeForCausalLM(cfg)


def gpt_model() -> torch.nn.Module:
    from nanogpt import GPT  # beside this script: a researcher's own model, blocks in an nn.ModuleList

    return GPT(vocab=VOCAB, n_layer=int(os.environ.get("EQ_LAYERS", "2")))


MODELS = {"ref": ref_model, "llama": llama_model, "moe": moe_model, "mixtral": mixtral_model,
          "qwen2_moe": qwen2_moe_model, "gpt": gpt_model}  # fmt: skip
AUX_COEF = 0.01
"""Weight of a mixture-of-experts model's load-balancing loss (``model.aux_loss()``) in the training loss."""


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def batch(step: int, n: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    noise = torch.randint(0, 3, (n, seq + 1), generator=g)
    return (start + 3 * torch.arange(seq + 1) + noise) % VOCAB


def full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name.removeprefix("module.")  # DDP's and DeepSpeed's engine's wrapped module


def main() -> None:
    if sys.argv[1] == "--many":
        return main_many(sys.argv[2])
    train(sys.argv[1], sys.argv[2])


def main_many(spec_path: str) -> None:
    """Each configuration of the spec in turn: the launch's environment plus its own, a fresh runtime, train."""
    from jupyter_dist.worker._runtime import fresh_runtime

    with open(spec_path) as f:
        configs = json.load(f)
    base = dict(os.environ)
    for i, cfg in enumerate(configs):
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(cfg["env"])
        if i:
            fresh_runtime()
        if cfg["env"].get("EQ_SCRIPT"):
            runpy.run_path(cfg["env"]["EQ_SCRIPT"], run_name="__main__")
            result: dict | None = {"script": cfg["env"]["EQ_SCRIPT"]}
        elif cfg["env"].get("EQ_REFUSE") == "1":
            try:
                train(cfg["out"], cfg["model"])
            except Exception as e:  # every rank refuses the same way, so the launch goes on to the next one
                result = {"refused": f"{type(e).__name__}: {e}"}
            else:
                result = {"refused": None}
        else:
            train(cfg["out"], cfg["model"])
            result = None
        if result is not None and jd.rank == 0:
            torch.save(result, cfg["out"])
        if dist.is_initialized():
            dist.barrier()
        if jd.rank == 0:
            print(f"EQ-CONFIG-DONE {cfg['out']}", flush=True)


def train(out_path: str, kind: str) -> None:
    steps = int(os.environ.get("EQ_STEPS", "5"))
    n, seq = int(os.environ.get("EQ_BATCH", "8")), int(os.environ.get("EQ_SEQ", "16"))
    torch.manual_seed(0)
    if os.environ.get("EQ_META") == "1":
        with torch.device("meta"):
            model = MODELS[kind]()
    else:
        model = MODELS[kind]()
    if os.environ.get("EQ_OPT", "adamw") == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=float(os.environ.get("EQ_LR", "1e-3")), weight_decay=0.1)
    pretrained = os.environ.get("EQ_PRETRAINED") or None
    model, opt = jd.wrap(model, opt, pretrained=pretrained)
    if os.environ.get("EQ_EP_EFSDP_DIVIDE") == "1":  # the mistake: FSDP2's default divisor for expert gradients
        for m in model.modules():
            if getattr(m, "num_experts", 0) and callable(getattr(m, "set_gradient_divide_factor", None)):
                m.set_gradient_divide_factor(float(jd.mesh.expert["efsdp"].size()))
    if os.environ.get("EQ_SYNC_EVERY_MICROBATCH") == "1":  # the mistake: no skipped reductions while accumulating
        import contextlib

        if hasattr(model, "no_sync"):
            model.no_sync = contextlib.nullcontext
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync = lambda *_, **__: None
    first = 0
    ckpt = os.environ.get("EQ_CKPT")
    if ckpt and os.environ.get("EQ_RESUME") == "1":
        got = jd.resume({"model": model, "optimizer": opt}, root=ckpt)
        assert got is not None, "nothing to resume"
        first = got[1] + 1
    measured_grads: list[int] = []
    if os.environ.get("EQ_MEASURE") == "1":  # gradient bytes right before the step clears them (any loop form)
        clear = opt.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            measured_grads.append(sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None))
            clear(set_to_none=set_to_none)

        opt.zero_grad = zero_grad
    # micro-batches whose activations the first pipeline rank holds at once (forwards whose backward has not run),
    # over all its stages (two under interleaved 1F1B), and the blocks they span
    in_flight = {"now": 0, "max": 0, "blocks": 0, "max_blocks": 0}
    from jupyter_dist.worker._runtime import get_runtime

    pipe = get_runtime().pipeline
    if pipe is not None and pipe.is_first:
        from jupyter_dist.worker._strategy import find_blocks

        for stage in pipe.stages:
            module = stage.submod
            blocks = find_blocks(module)  # the reference model's layers, a Hugging Face model's model.layers
            n_blocks = len(blocks)

            def fwd(*_: object, n: int = n_blocks) -> None:
                in_flight["now"] += 1
                in_flight["blocks"] += n
                in_flight["max"] = max(in_flight["max"], in_flight["now"])
                in_flight["max_blocks"] = max(in_flight["max_blocks"], in_flight["blocks"])

            def bwd(*_: object, n: int = n_blocks) -> None:
                in_flight["now"] -= 1
                in_flight["blocks"] -= n

            module.register_forward_hook(fwd)
            blocks[0].register_full_backward_hook(bwd)
    comm_stats = get_runtime().comm_stats if os.environ.get("EQ_COUNT_COMM") == "1" else None
    if os.environ.get("EQ_COUNT_COMM") == "1" and comm_stats is None:
        raise SystemExit("EQ_COUNT_COMM=1 needs the runtime's comm stats: set JD_RUN_DIR (and not JD_COMM_TIMING=0)")
    comm: list[dict[str, int]] = []  # per step: collectives issued inside the training step, by name
    save_at = int(os.environ.get("EQ_SAVE_AT", "-1"))
    step_form = os.environ.get("EQ_STEP_FORM") == "1" or int(os.environ.get("JD_PP", "1")) > 1

    def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        if callable(getattr(model, "aux_loss", None)):  # mixture of experts (under pp: the stages carry it)
            loss = loss + AUX_COEF * model.aux_loss()
        return loss

    losses = []
    for step in range(first, steps):
        tokens = batch(step, n, seq)
        if n % jd.dp_size:
            raise SystemExit(f"batch {n} does not split over dp {jd.dp_size}")
        if os.environ.get("EQ_BAD_DATA") == "1":  # the classic mistake: shard data by global rank under tp
            local = tokens.chunk(jd.world_size)[jd.rank]
        else:
            local = tokens.chunk(jd.dp_size)[jd.dp_rank]
        # per step (the first step also runs the schedule's shape inference)
        in_flight.update(now=0, max=0, blocks=0, max_blocks=0)
        if step_form:  # the form that runs under every plan (pipelines, context parallelism included)
            if comm_stats is not None:
                comm_stats.take()  # drop what came before the step
            value = jd.train_step(local[:, :-1], local[:, 1:], loss_fn).clone()
            if comm_stats is not None:
                taken = comm_stats.take() or {"ops": {}}
                comm.append({op: v["count"] for op, v in taken["ops"].items()})
            grad_bytes = 0
        else:
            # context parallelism: this rank's chunks of the sequence (identity without it)
            inputs, targets = jd.cp_shard(local[:, :-1], local[:, 1:])
            if os.environ.get("EQ_BAD_POSITIONS") == "1":  # the classic CP mistake: rotary angles from the chunk
                logits = model(inputs, positions=None)
            else:
                logits = logits_of(model, inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            if callable(getattr(model, "aux_loss", None)):
                loss = loss + AUX_COEF * model.aux_loss()
            loss.backward()
            grad_bytes = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            # tensor-parallel ranks hold the same loss; cp ranks the means over equal chunks: the mean over dp x cp
            value /= dist.get_world_size()
        losses.append(value.item())
        if step == save_at:
            jd.save({"model": model, "optimizer": opt}, step, root=ckpt)
    if steps > first and os.environ.get("EQ_MEASURE") == "1":  # what this rank holds, for the memory-vs-plan test
        states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        measured = {
            "params": sum(local_bytes(p) for p in model.parameters()),
            "grads": measured_grads[-1] if measured_grads else grad_bytes,
            "optimizer": sum(local_bytes(v) for v in states),
        }
        if pipe is not None:
            measured["in_flight"] = in_flight["max"]
            measured["in_flight_blocks"] = in_flight["max_blocks"]
        with open(f"{out_path}.rank{jd.rank}.json", "w") as f:
            json.dump(measured, f)
    params = {clean(k): full(p) for k, p in model.named_parameters()}
    if int(os.environ.get("JD_PP", "1")) > 1:  # each rank holds its stages' parameters: rank 0 collects them all
        torch.save(params, f"{out_path}.params{jd.rank}")
        dist.barrier()
        if jd.rank == 0:
            for r in range(jd.world_size):
                params.update(torch.load(f"{out_path}.params{r}"))
    first_logits = None
    if os.environ.get("EQ_LOGITS") == "1":
        with torch.no_grad():
            first_logits = full(logits_of(model, batch(0, n, seq)[:, :-1]))
    if jd.rank == 0:
        torch.save(
            {
                "losses": losses,
                "params": params,
                "first": first,
                "mesh": str(jd.mesh and jd.mesh.describe()),
                "logits": first_logits,
                "comm": comm,
                # a DeepSpeed engine's optimizer steps and micro-steps (its gradient accumulation)
                "engine_steps": [int(getattr(model, "global_steps", -1)), int(getattr(model, "micro_steps", -1))],
            },
            out_path,
        )
        print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
