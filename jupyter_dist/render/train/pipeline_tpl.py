"""Templates: pipeline parallelism.

The stage split balanced by cost, the schedules, per-stage checkpoints and the pipelined ``main()``.
"""

from __future__ import annotations

from .loop_tpl import LATEST_CHECKPOINT
from .parallel_tpl import CLIP_BY_TOTAL, SQUARES_PER_MESH

__all__ = ["ARGS_PIPELINE", "HELD", "PIPELINE", "CLIP_PIPELINE", "CHECKPOINT_PIPELINE", "MAIN_PIPELINE"]

ARGS_PIPELINE = """
parser.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULE, help="pipeline schedule")
parser.add_argument(
    "--stages-per-rank", type=int, default=0, help="pipeline stages per rank (0: 2 for interleaved-1f1b, else 1)"
)
"""

HELD = '''
def held(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of ``plan`` whose modules this pipeline stage holds (the others live on other ranks)."""
    names = [name for name, _ in model.named_modules()]
    return {key: style for key, style in plan.items() if any(fnmatch.fnmatchcase(name, key) for name in names)}
'''

PIPELINE = '''
def check_pipeline(args: argparse.Namespace) -> None:
    """Check --schedule, --stages-per-rank and --grad-accum (the schedule's micro-batches) together."""
    interleaved = args.schedule == "interleaved-1f1b"
    if args.stages_per_rank == 0:
        args.stages_per_rank = 2 if interleaved else 1
    if interleaved and args.stages_per_rank < 2:
        raise SystemExit(f"--schedule interleaved-1f1b needs --stages-per-rank >= 2, got {args.stages_per_rank}")
    if not interleaved and args.stages_per_rank != 1:
        raise SystemExit(
            f"--schedule {args.schedule} runs one stage per rank; --stages-per-rank {args.stages_per_rank} needs "
            "--schedule interleaved-1f1b"
        )
    if args.schedule == "1f1b" and args.grad_accum < PP:
        raise SystemExit(
            f"1F1B needs at least as many micro-batches (--grad-accum {args.grad_accum}) as pipeline stages ({PP}); "
            "raise --grad-accum or use --schedule gpipe"
        )
    if args.layers < PP * args.stages_per_rank:
        raise SystemExit(
            f"{PP * args.stages_per_rank} pipeline stages need at least as many blocks; --layers is {args.layers}"
        )


def stage_bounds(n_layers: int, n_stages: int, last_extra: float) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` block ranges, one per stage, that minimise the most loaded stage.

    A block costs 1; the last stage also runs the norm and the head, worth ``last_extra`` blocks (the embeddings
    are lookups and cost next to nothing), so it gets fewer blocks when the vocabulary is large. Among splits with
    the same largest cost, the most even one (smallest sum of squared costs) wins.
    """
    if n_stages == 1:
        return [(0, n_layers)]
    extra = [0.0] * (n_stages - 1) + [last_extra]

    def capacities(limit: float) -> list[int] | None:
        caps = [int(limit - e + 1e-9) for e in extra]  # the most blocks each stage can take under the limit
        return caps if min(caps) >= 1 and sum(caps) >= n_layers else None

    limits = sorted({k + e for k in range(1, n_layers + 1) for e in (0.0, last_extra)})
    caps = next(c for c in (capacities(m) for m in limits) if c is not None)
    for _ in range(sum(caps) - n_layers):  # take blocks from the costliest stages (ties: the later one)
        i = max((k for k in range(n_stages) if caps[k] > 1), key=lambda k: (caps[k] + extra[k], k))
        caps[i] -= 1
    starts = [sum(caps[:k]) for k in range(n_stages)]
    return [(start, start + c) for start, c in zip(starts, caps, strict=True)]


def keep_stage_part(model: nn.Module, start: int, end: int, *, first: bool, last: bool) -> None:
    """REPLACE for your model: keep only what one pipeline stage runs.

    Blocks ``start..end-1`` under their whole-model keys, the embeddings on the first stage, the norm and the head on
    the last; the other parts become None, which forward skips.
    """
    for key in list(model.blocks):
        if not start <= int(key) < end:
            del model.blocks[key]
    if not first:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.norm = model.head = None


def split_model(model: nn.Module, mesh: DeviceMesh, args: argparse.Namespace) -> list[tuple[int, nn.Module]]:
    """The pipeline stages this rank holds, as (stage index, module), cut at block boundaries balanced by cost.

    ``PP x --stages-per-rank`` stages; stage ``i`` goes to pp rank ``i % PP`` (the looped placement interleaved 1F1B
    expects). Every rank built the whole model from the same seed, so each stage starts from the weights a run
    without a pipeline has; a stage is a skeleton built on the meta device (no memory) that keeps its parts and takes
    their tensors from the whole model. (A model too large for one host's memory: build it on the meta device too,
    then initialise or load each stage's parts.)
    """
    n_stages = PP * args.stages_per_rank
    per_block = sum(p.numel() for p in model.blocks["0"].parameters())
    head = sum(p.numel() for part in (model.norm, model.head) for p in part.parameters())
    bounds = stage_bounds(len(model.blocks), n_stages, last_extra=head / per_block)
    whole = model.state_dict()
    stages = []
    for index in range(mesh["pp"].get_local_rank(), n_stages, PP):
        with torch.device("meta"):
            stage = build_model(args)
        keep_stage_part(stage, *bounds[index], first=index == 0, last=index == n_stages - 1)
        stage.load_state_dict(whole, strict=False, assign=True)  # the kept parts' tensors, not copies
        stages.append((index, stage))
    if dist.get_rank() == 0:
        cuts = ", ".join(f"{i}: {start}..{end - 1}" for i, (start, end) in enumerate(bounds))
        print(f"pipeline stages (blocks): {cuts}", flush=True)
    return stages


def build_schedule(
    <<schedule_params>>
) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
    """The schedule that runs forward and backward of this rank's stages over ``--grad-accum`` micro-batches.

    GPipe runs every micro-batch's forward, then every backward (all of them in flight); 1F1B alternates one forward
    and one backward once the pipeline is full (at most PP in flight on the first stage; the bubble is
    (PP - 1) / micro-batches of the step); interleaved 1F1B gives each rank several smaller stages, which shrinks
    the bubble by that factor for more point-to-point traffic. Gradients are scaled by 1 / micro-batches (the loss
    of a step is the mean of its micro-batches', as without a pipeline).
    """
    n_stages = PP * args.stages_per_rank
    group = mesh["pp"].get_group()
    pipeline = [PipelineStage(stage, index, n_stages, device, group=group) for index, stage in stages]
    if args.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pipeline, args.grad_accum, loss_fn=<<schedule_loss>>)
    schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    return schedule(pipeline[0], args.grad_accum, loss_fn=<<schedule_loss>>)
'''

CLIP_PIPELINE = (
    '''
def clip_grad_norm(stages: list[nn.Module], max_norm: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Clip to ``max_norm``; return the norm of all gradients over every rank's shards and every pipeline stage.

    The gradients are DTensors, on one mesh per kind of layout (with tensor parallelism: (dp, tp) for the split
    layers, dp for the ones kept whole), which torch.nn.utils.clip_grad_norm_ cannot mix: each mesh's squared norm is
    reduced apart, then the stages' squares are summed over ``pp``.
    """
    groups: dict[object, list[nn.Parameter]] = {}  # the parameters by the mesh their gradients live on
    for stage in stages:
        for param in stage.parameters():
            if param.grad is not None:
                mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
                groups.setdefault(mesh, []).append(param)
'''
    + SQUARES_PER_MESH
    + """    total = torch.stack(squares).sum()
    dist.all_reduce(total, group=pp_group)  # add the other stages' squares
    total = total.sqrt()
"""
    + CLIP_BY_TOTAL
)

CHECKPOINT_PIPELINE = (
    LATEST_CHECKPOINT
    + r'''

# one key per parameter (state.<name>.exp_avg, param_groups.<name>.lr): the stages' optimizer states merge into one
# dict without clashing, and a stage that resumes reads its own parameters' groups (the nested form keeps one list
# of param groups, which differs from stage to stage)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def pipeline_state(
    stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The checkpoint's state (this rank's stages merged, whole-model names) and each stage's own state dicts."""
    parts = [
        get_state_dict(model, optimizer, options=FLAT) for model, optimizer in zip(stages, optimizers, strict=True)
    ]
    state = {"model": {}, "optim": {}, "step": step}
    for model_state, optim_state in parts:
        state["model"].update(model_state)
        state["optim"].update(optim_state)
    return state, parts


def save_checkpoint(stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int, root: Path) -> None:
    """Save with torch.distributed.checkpoint: each rank writes its stages' shards to ``root/step-<N>``."""
    state, _ = pipeline_state(stages, optimizers, step)
    dcp.save(state, checkpoint_id=root / f"step-{step}")


def load_checkpoint(stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], root: Path) -> int:
    """Resume from the newest checkpoint under ``root`` (saved under any pipeline split); return its step."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0
    step, path = latest
    state, parts = pipeline_state(stages, optimizers, step)
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the pieces of its own stages' shards
    for stage, optimizer, (model_state, optim_state) in zip(stages, optimizers, parts, strict=True):
        set_state_dict(
            stage, optimizer, model_state_dict={k: state["model"][k] for k in model_state},
            optim_state_dict={k: state["optim"][k] for k in optim_state}, options=FLAT,
        )
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"])
'''
)

MAIN_PIPELINE = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    check_pipeline(args)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    mesh = build_mesh(device)
    stages = [(index, parallelize(stage, mesh, args)) for index, stage in split_model(build_model(args), mesh, args)]
    models = [stage for _, stage in stages]
    optimizers = [build_optimizer(model, args) for model in models]  # one per stage, as its checkpoint is
    <<scaler>>
    schedule = build_schedule(stages, mesh, args, device<<schedule_args>>)
    first, last = stages[0][0] == 0, stages[-1][0] == PP * args.stages_per_rank - 1
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(models, optimizers, checkpoint_dir)

    <<dp_ranks>>
    batches = None
    if first or last:
        dataset = build_dataset(args)
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, seed=args.seed, drop_last=True)
        loader = DataLoader(  # one batch per optimizer step: the schedule splits it into --grad-accum micro-batches
            dataset, batch_size=args.micro_batch * args.grad_accum, sampler=sampler, num_workers=args.num_workers,
            drop_last=True, pin_memory=device.type == "cuda",
        )
        batches = micro_batches(loader, sampler, start=start_step)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), {PRECISION}, steps {start_step + 1}..{args.steps}",
              flush=True)
        print("mesh", " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
              f"schedule {args.schedule}, {args.grad_accum} micro-batches", flush=True)

    for model in models:
        model.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        inputs = targets = None
        if batches is not None:
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        losses: list[torch.Tensor] = []  # filled on the last stage: one loss per micro-batch
        <<schedule_step>>
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
        <<clip>>
        <<optimizer_step>>

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss)  # the sum of the last stage's ranks' mean losses (the other ranks add zeros)
            if rank == 0:
                tokens = args.micro_batch * args.grad_accum * args.seq_len * dp_size
                print(
                    f"step {step}/{args.steps} loss {loss.item() / <<loss_ranks>>:.6f} "
                    f"grad-norm {grad_norm.item():.3f} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(models, optimizers, step, checkpoint_dir)
    dist.destroy_process_group()
'''
