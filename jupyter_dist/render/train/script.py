"""The assembled script: ``main()`` on top of the sections of :mod:`.parallel` and :mod:`.base`.

The training loop for torch strategies, pipelines and DeepSpeed.
"""

from __future__ import annotations

from . import loop_tpl as lt
from . import pipeline_tpl as ppt
from .parallel import ParallelSections
from .text import fill, join_lines

__all__ = ["Script"]


class Script(ParallelSections):
    """The sections of one script; :meth:`main` last, once the others have recorded their imports."""

    def _main_pipeline(self) -> str:
        dp_ranks = join_lines(
            "# data parallelism by replica, not by rank: the mesh is (pp, dp, tp) with tp innermost, so the TP "
            "ranks of a",
            "# replica are neighbours and its stages are world_size // PP ranks apart; they all take replica "
            "dp_rank's batch,",
            "# of which the first stage reads the inputs and the last the targets (the other stages read nothing)",
            "dp_size = world_size // (PP * TP)",
            "dp_rank = (rank // TP) % dp_size",
        )
        step = join_lines(
            "# forward and backward of every micro-batch in the schedule's order; FSDP2 reduce-scatters the gradients",
            "# after each stage's last backward",
            "schedule.step(*([inputs] if first else []), target=targets if last else None, losses=losses)",
        )
        loss_ranks = "(dp_size * TP)"
        if self.cp > 1:
            dp_ranks = join_lines(
                "# data parallelism by replica, not by rank: the mesh is (pp, dp, cp, tp), tp innermost, so the",
                "# CP x TP ranks of a replica are neighbours, its stages world_size // PP ranks apart; they take",
                "# replica dp_rank's batch, of which the first stage reads the inputs and the last the targets",
                "dp_size = world_size // (PP * CP * TP)",
                "dp_rank = (rank // (CP * TP)) % dp_size",
            )
            step = join_lines(
                "# the tokens' places in the sequences, one row per sequence (the schedule splits the rows into",
                "# micro-batches)",
                "positions = torch.arange(args.seq_len, device=device).expand(args.micro_batch * args.grad_accum, -1)",
                "positions = positions.contiguous()",
                "buffers = [t for t in (inputs, targets) if t is not None] + [positions]",
                "# forward and backward of every micro-batch in the schedule's order, on this rank's part of the",
                "# sequences (cut in place); FSDP2 reduce-scatters the gradients after each stage's last backward",
                'with sequence_split(mesh["cp"], *buffers):',
                "    schedule.step(",
                '        *([inputs] if first else []), **({"positions": positions} if first else {}),',
                "        target=targets if last else None, losses=losses,",
                "    )",
            )
            loss_ranks = "(dp_size * CP * TP)"
        clip = join_lines(
            'max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")  # inf: measure, do not clip',
            'grad_norm = clip_grad_norm(models, max_norm, mesh["pp"].get_group())',
        )
        optimizer_step = join_lines(
            "for optimizer in optimizers:", "    optimizer.step()", "    optimizer.zero_grad(set_to_none=True)"
        )
        scaler, schedule_args = "", ""
        if self.fp16:
            scaler = join_lines(
                "# fp16: one dynamic loss scale for every stage: the last stage scales the loss, every stage unscales",
                "# its gradients, and an overflow on any rank skips the step everywhere (scales are not checkpointed)",
                f"scaler = {self._scaler_class()}(device=device.type)",
                "scaler.scale(torch.zeros((), device=device))  # sets the scale on ranks without a loss (first stages)",
                "",
                "def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:",
                "    return scaler.scale(loss_fn(logits, targets))",
                "",
            )
            schedule_args = ", loss=scaled_loss"
            clip = join_lines(
                "loss = loss / scaler.get_scale()  # the schedule's losses are scaled",
                "for optimizer in optimizers:",
                "    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones",
                clip,
            )
            optimizer_step = join_lines(
                "for optimizer in optimizers:",
                "    scaler.step(optimizer)  # skipped when a gradient overflowed on any rank",
                "    optimizer.zero_grad(set_to_none=True)",
                "scaler.update()",
            )
        return fill(ppt.MAIN_PIPELINE, clip=clip, dp_ranks=dp_ranks, schedule_step=step, loss_ranks=loss_ranks,
                    optimizer_step=optimizer_step, scaler=scaler, schedule_args=schedule_args)  # fmt: skip

    def main(self) -> str:
        """``main()``: set-up, the training loop, logging and checkpoints."""
        if self.ds:
            self.use("json")
            return fill(lt.MAIN_DEEPSPEED, activation_checkpointing=self.activation_checkpointing(),
                        compile=self.speed_lines()["compile"])  # fmt: skip
        fam = self.family
        if self.pp > 1:
            return self._main_pipeline()
        backward = "scaler.scale(loss).backward()" if self.fp16 else "loss.backward()"
        forward = "loss = compute_loss(model, inputs, targets) / args.grad_accum"
        if fam == "ddp" and self.mixed:
            forward = join_lines(
                f"with torch.autocast(device.type, dtype={self.compute_dtype}):  # {self.precision.value}",
                "    " + forward,
            )
        if fam in ("ddp", "fsdp"):
            self.use("contextlib")
            verb = "all-reduce" if fam == "ddp" else "reduce-scatter"
            micro = join_lines(
                f"# {verb} gradients only after the last micro-step: no_sync() accumulates them locally before",
                "sync = contextlib.nullcontext() if last else model.no_sync()",
                "with sync:",
                *("    " + x for x in forward.split("\n")),
                "    " + backward,
            )
        elif self.cp > 1:
            micro = join_lines(
                "model.set_requires_gradient_sync(last)  # reduce-scatter gradients only after the last micro-step",
                "positions = torch.arange(inputs.shape[1], device=device).unsqueeze(0)  # the tokens' places",
                "# forward and backward on this rank's part of the sequences (inputs, targets, positions cut in place)",
                'with sequence_split(mesh["cp"], inputs, targets, positions):',
                "    loss = loss_fn(model(inputs, positions), targets) / args.grad_accum",
                "    " + backward,
            )
        else:
            micro = join_lines(
                "model.set_requires_gradient_sync(last)  # reduce-scatter gradients only after the last micro-step",
                forward,
                backward,
            )
        clip = ['max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")  # inf: measure, do not clip']
        if self.fp16:
            clip.insert(0, "scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones")
        if fam == "fsdp":
            clip.append("grad_norm = model.clip_grad_norm_(max_norm)  # FSDP's own: the norm over all shards")
        elif self.meshed:
            clip.append("grad_norm = clip_grad_norm(model, max_norm)")
        else:
            clip.append("grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
        if fam == "fsdp2" and not self.meshed:
            self.use_from("torch.distributed.tensor", "DTensor")
            clip += ["if isinstance(grad_norm, DTensor):", "    grad_norm = grad_norm.full_tensor()"]
        if self.fp16:
            step = join_lines("scaler.step(optimizer)  # skipped when a gradient overflowed", "scaler.update()")
            if fam == "ddp":
                scaler = "scaler = torch.amp.GradScaler(device.type)  # fp16: dynamic loss scaling"
            else:
                scaler = f"scaler = {self._scaler_class()}(device=device.type)  # fp16: inf checks on all ranks"
            scaler_arg = ", scaler"
        else:
            step, scaler, scaler_arg = "optimizer.step()", "", ""
        teardown = ""
        if fam == "ddp":
            # measured: without this, 4 of 6 two-rank gloo runs hung at exit (the reducer's destructor joins gloo's
            # worker threads while holding the GIL, and a worker waits for the GIL to free its last tensors)
            teardown = join_lines(
                "# DDP's reducer holds the process group: free it first, so that destroy_process_group() tears the",
                "# group down (releasing the GIL), not the reducer's destructor at exit, which can deadlock on gloo",
                "del model, optimizer",
            )
        data: dict[str, str] = {"build": "model = parallelize(build_model(args), device, args)", "dp_ranks": "",
                                "dp_size": "world_size", "dp_rank": "rank", "describe_mesh": ""}  # fmt: skip
        if self.meshed:
            dp_ranks = join_lines(
                "# data parallelism by replica, not by rank: tp is the mesh's innermost dimension, so ranks",
                "# k*TP .. k*TP+TP-1 hold one model replica together and must all load replica k's batch",
                "dp_rank, dp_size = rank // TP, world_size // TP",
            )
            if self.cp > 1:
                dp_ranks = join_lines(
                    "# data parallelism by replica, not by rank: cp and tp are the mesh's innermost dimensions, so",
                    "# ranks k*CP*TP .. (k+1)*CP*TP-1 split one replica's sequences and all load replica k's batch",
                    "dp_rank, dp_size = rank // (CP * TP), world_size // (CP * TP)",
                )
            elif self.tp == 1:
                dp_ranks = join_lines(
                    "# every rank is a data-parallel replica (expert parallelism borrows its ranks from them)",
                    "dp_rank, dp_size = rank, world_size",
                )
            data = {
                "build": join_lines("mesh = build_mesh(device)", "model = parallelize(build_model(args), mesh, args)"),
                "dp_ranks": dp_ranks,
                "dp_size": "dp_size", "dp_rank": "dp_rank",
                "describe_mesh": 'print("mesh", " x ".join(f"{n}={s}" for n, s in '
                                 "zip(mesh.mesh_dim_names, mesh.shape, strict=True)))",
            }  # fmt: skip
        return fill(lt.MAIN_TORCH, micro_step=micro, clip=join_lines(*clip), optimizer_step=step, scaler=scaler,
                     scaler_arg=scaler_arg, teardown=teardown, **data)  # fmt: skip
