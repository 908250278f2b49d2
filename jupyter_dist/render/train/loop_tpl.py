"""Templates: the optimizer, the data iterator, checkpoints and the training loop.

The optimizers, the micro-batch iterator, DCP and DeepSpeed checkpoints, and ``main()`` for torch strategies and
DeepSpeed.
"""

from __future__ import annotations

from ...plan.training import OptimizerKind

__all__ = [
    "OPTIMIZERS", "MICRO_BATCHES", "LATEST_CHECKPOINT", "CHECKPOINT_DCP", "CHECKPOINT_DEEPSPEED", "MAIN_TORCH",
    "MAIN_DEEPSPEED",
]  # fmt: skip

OPTIMIZERS = {
    OptimizerKind.ADAMW: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay; the learning rate stays constant."""
    <<fused>>
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay<<fused_arg>>)
''',
    OptimizerKind.SGD: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with momentum 0.9; the learning rate stays constant."""
    <<fused>>
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay<<fused_arg>>)
''',
    OptimizerKind.ADAMW_8BIT: '''
def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """8-bit AdamW from bitsandbytes (one byte per optimizer state); the learning rate stays constant."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise SystemExit("the plan uses 8-bit AdamW, which needs bitsandbytes: pip install bitsandbytes") from err
    return bnb.optim.AdamW8bit(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
''',
}

MICRO_BATCHES = '''
def micro_batches(loader: DataLoader, sampler: DistributedSampler, start: int) -> Iterator[list[torch.Tensor]]:
    """Endless micro-batches, reshuffled each epoch (``set_epoch``), skipping the ``start`` already trained on."""
    epoch, skip = divmod(start, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield batch
        epoch, skip = epoch + 1, 0
'''

LATEST_CHECKPOINT = r'''
def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as (step, folder); DCP writes ``.metadata`` last."""
    found = [
        (int(match.group(1)), path)
        for path in root.glob("step-*")
        if (match := re.fullmatch(r"step-(\d+)", path.name)) and (path / ".metadata").exists()
    ]
    return max(found) if found else None
'''
"""Checkpoint discovery, the same for every DCP checkpoint (:data:`CHECKPOINT_DCP`, the pipeline's)."""

CHECKPOINT_DCP = (
    LATEST_CHECKPOINT
    + r'''

def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer<<scaler_param>>, step: int, root: Path
) -> None:
    """Save with torch.distributed.checkpoint: each rank writes its own shards to ``root/step-<N>``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": step}
    <<scaler_state>>
    dcp.save(state, checkpoint_id=root / f"step-{step}")


def load_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer<<scaler_param>>, root: Path
) -> int:
    """Resume from the newest checkpoint under ``root``; return its step (0 when there is none)."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0
    step, path = latest
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": step}
    <<scaler_state>>
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the pieces of its own shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    <<scaler_load>>
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {state['step']}", flush=True)
    return int(state["step"])
'''
)

CHECKPOINT_DEEPSPEED = '''
# DeepSpeed's own checkpoint format: torch.distributed.checkpoint's get_state_dict() does not know ZeRO's partitions.
def save_checkpoint(engine: deepspeed.DeepSpeedEngine, step: int, root: Path) -> None:
    """Save the engine (each rank writes its ZeRO partitions) to ``root/step-<N>``; ``root/latest`` names it."""
    engine.save_checkpoint(str(root), tag=f"step-{step}", client_state={"step": step})


def load_checkpoint(engine: deepspeed.DeepSpeedEngine, root: Path) -> int:
    """Resume from the checkpoint ``root/latest`` names; return its step (0 when there is none)."""
    if not (root / "latest").exists():
        return 0
    path, client_state = engine.load_checkpoint(str(root))
    if path is None:
        raise SystemExit(f"could not load the checkpoint that {root / 'latest'} names")
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {client_state['step']}", flush=True)
    return int(client_state["step"])
'''

MAIN_TORCH = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    <<build>>
    optimizer = build_optimizer(model, args)
    <<scaler>>
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(model, optimizer<<scaler_arg>>, checkpoint_dir)

    dataset = build_dataset(args)
    <<dp_ranks>>
    sampler = DistributedSampler(dataset, num_replicas=<<dp_size>>, rank=<<dp_rank>>, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=args.num_workers, drop_last=True,
        pin_memory=device.type == "cuda",
    )
    batches = micro_batches(loader, sampler, start=start_step * args.grad_accum)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), {PRECISION}, steps {start_step + 1}..{args.steps}",
              flush=True)
        <<describe_mesh>>

    model.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(args.grad_accum):
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
            last = micro_step == args.grad_accum - 1
            <<micro_step>>
            loss_sum += loss.detach()
        <<clip>>
        <<optimizer_step>>
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)  # the sum of the ranks' mean losses
            if rank == 0:
                tokens = args.micro_batch * args.grad_accum * args.seq_len * <<dp_size>>
                print(
                    f"step {step}/{args.steps} loss {loss_sum.item() / world_size:.6f} "
                    f"grad-norm {grad_norm.item():.3f} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(model, optimizer<<scaler_arg>>, step, checkpoint_dir)
    <<teardown>>
    dist.destroy_process_group()
'''

MAIN_DEEPSPEED = '''
def main(argv: list[str] | None = None) -> None:
    """Train for ``--steps`` optimizer steps; resume from the newest checkpoint in ``--checkpoint-dir``."""
    args = parse_args(argv)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args)
    <<activation_checkpointing>>
    <<compile>>
    config = json.loads(Path(args.deepspeed_config).read_text())
    optimizer = None if "optimizer" in config else build_optimizer(model, args)  # the config's optimizer wins
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    micro_batch, grad_accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if rank == 0 and (micro_batch, grad_accum) != (MICRO_BATCH, GRAD_ACCUM):
        print(
            f"note: {args.deepspeed_config} sets micro-batch {micro_batch} x accumulation {grad_accum}; "
            f"the plan has {MICRO_BATCH} x {GRAD_ACCUM}",
            flush=True,
        )
    checkpoint_dir = Path(args.checkpoint_dir)
    start_step = load_checkpoint(engine, checkpoint_dir)

    dataset = build_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, num_workers=args.num_workers, drop_last=True,
        pin_memory=device.type == "cuda",
    )
    batches = micro_batches(loader, sampler, start=start_step * grad_accum)
    if rank == 0:
        print(f"{STRATEGY} on {world_size} ranks ({device.type}), steps {start_step + 1}..{args.steps}", flush=True)

    engine.train()
    for step in range(start_step + 1, args.steps + 1):
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=engine.device)
        for _ in range(grad_accum):
            inputs, targets = (t.to(engine.device, non_blocking=True) for t in next(batches))
            loss = compute_loss(engine, inputs, targets)
            engine.backward(loss)  # scales by 1 / accumulation; reduces gradients at the boundary
            engine.step()  # steps the optimizer (and clips) only at the accumulation boundary
            loss_sum += loss.detach().float() / grad_accum

        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(loss_sum)  # the sum of the ranks' mean losses
            if rank == 0:
                tokens = micro_batch * grad_accum * args.seq_len * world_size
                grad_norm = engine.get_global_grad_norm()
                norm = "n/a" if grad_norm is None else f"{float(grad_norm):.3f}"
                print(
                    f"step {step}/{args.steps} loss {loss_sum.item() / world_size:.6f} "
                    f"grad-norm {norm} tokens/s {tokens / (time.perf_counter() - started):,.0f}",
                    flush=True,
                )
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(engine, step, checkpoint_dir)
    dist.destroy_process_group()
'''
