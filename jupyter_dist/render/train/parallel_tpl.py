"""Templates: how the model is spread over the processes.

``parallelize()`` for DDP, FSDP (FSDP1) and FSDP2, HSDP's 2-D mesh, the tensor-parallel layout, ``build_mesh()`` and
gradient clipping over DTensors on several meshes.
"""

from __future__ import annotations

__all__ = [
    "PARALLELIZE_DDP", "PARALLELIZE_FSDP", "PARALLELIZE_FSDP2", "HYBRID_MESH", "TP_PLAN", "BUILD_MESH",
    "PARALLELIZE_FSDP2_TP", "SQUARES_PER_MESH", "CLIP_BY_TOTAL", "CLIP_MESHES",
]  # fmt: skip

PARALLELIZE_DDP = '''
def parallelize(model: nn.Module, device: torch.device, args: argparse.Namespace) -> nn.Module:
    """DDP: a full replica on every rank; gradients are all-reduced in buckets while backward runs."""
    model = model.to(device<<to_dtype>>)
    <<float8>>
    <<activation_checkpointing>>
    <<compile>>
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=BUCKET_CAP_MB,
        gradient_as_bucket_view=True,  # gradients are views into the buckets: no extra copy
    )
'''

PARALLELIZE_FSDP = '''
def parallelize(model: nn.Module, device: torch.device, args: argparse.Namespace) -> nn.Module:
    """FSDP (<<sharding>>): one FSDP unit per block plus the root (embeddings, head)."""
    <<float8>>
    <<precision>>
    <<mesh>>
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BLOCK_CLASS}),
        sharding_strategy=ShardingStrategy.<<sharding>>,
        mixed_precision=<<mixed_precision>>,
        device_id=device,  # also on CPU: without it FSDP refuses to run where there is no accelerator
        use_orig_params=True,  # optimizer and checkpoints see the original parameters, not flat ones
        <<device_mesh>>
    )
    <<activation_checkpointing>>
    <<compile>>
    return model
'''

PARALLELIZE_FSDP2 = '''
def parallelize(model: nn.Module, device: torch.device, args: argparse.Namespace) -> nn.Module:
    """FSDP2: shard each block's parameters (as DTensors), then the rest of the model at the root."""
    <<mesh>>
    <<precision>>
    <<float8>>
    <<activation_checkpointing>>
    <<compile>>
    for module in model.modules():
        if isinstance(module, BLOCK_CLASS):
            fully_shard(module, mesh=mesh<<policy>>)
    fully_shard(model, mesh=mesh<<policy>>)  # also moves the shards to the mesh's device
    return model
'''

HYBRID_MESH = """
world_size = dist.get_world_size()
if world_size % SHARD_GROUP_SIZE:
    raise SystemExit(f"world size {world_size} is not a multiple of the shard group size {SHARD_GROUP_SIZE}")
# <<what>>
mesh = init_device_mesh(
    device.type, (world_size // SHARD_GROUP_SIZE, SHARD_GROUP_SIZE), mesh_dim_names=<<names>>
)
"""

TP_PLAN = '''
def tp_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """REPLACE with your model's layout: module name (``*`` for any one name) -> how tensor parallelism splits it.

    Megatron-LM's layout (Shoeybi et al. 2019): the attention's q/k/v projections and the MLP's first linear are split
    by output features (column-wise: each tp rank computes some of the heads, some of the MLP width), the attention's
    output projection and the MLP's second linear by input features (row-wise: partial sums, added up across the tp
    ranks), the token embedding by vocabulary rows and the head by vocabulary columns. The tp degree must divide the
    heads, the MLP width and the vocabulary. With sequence parallelism (Korthikanti et al. 2022) the residual stream
    between the blocks and the norms are split along the sequence (dim 1) instead of replicated: gathered before the
    attention and the MLP, reduce-scattered after them.
    """
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between the blocks
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.out_proj": RowwiseParallel(output_layouts=stream),
        <<mlp_plan>>
        "head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),  # whole logits on every tp rank
    }
    if sequence_parallel:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        plan.update({
            # the position table stays whole: the stream is split once it is added, at the first block's input
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "blocks.*.attn_norm": SequenceParallel(use_local_output=True),
            "blocks.*.mlp_norm": SequenceParallel(use_local_output=True),
            "norm": SequenceParallel(use_local_output=True),
            "blocks.*.attn": PrepareModuleInput(**gather),  # all-gather the sequence (reduce-scatter in backward)
            <<mlp_sp>>
        })
    return plan
'''

BUILD_MESH = '''
def build_mesh(device: torch.device) -> DeviceMesh:
    """The device mesh <<shape>><<innermost>>.

    <<what>>
    """
    world_size, unit = dist.get_world_size(), <<unit>>
    if world_size % unit:
        raise SystemExit(f"{world_size} processes: not a multiple of <<unit_what>> = {unit}")
    sizes = (<<sizes>>)
    return init_device_mesh(device.type, sizes, mesh_dim_names=(<<names>>))
'''

PARALLELIZE_FSDP2_TP = '''
def parallelize(model: nn.Module, mesh: DeviceMesh, args: argparse.Namespace) -> nn.Module:
    """<<doc>>"""
    <<precision_model>>
    <<tensor_parallel>>
    <<float8>>
    <<activation_checkpointing>>
    <<compile>>
    <<precision>>
    <<dp_mesh>>
    <<shard_experts>>
    for module in model.modules():
        if isinstance(module, BLOCK_CLASS):
            fully_shard(module, mesh=dp_mesh<<policy>>)
    <<shard_root>>
    return model
'''

SQUARES_PER_MESH = """\
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
"""
"""Gradient clipping over DTensors: each mesh's squared gradient norm, apart (``groups``: mesh -> parameters)."""

CLIP_BY_TOTAL = """\
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
"""
"""Gradient clipping over DTensors: scale every mesh's gradients by the one ``total`` norm, and return it."""

CLIP_MESHES = (
    '''
def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm``; return the norm of all gradients over every rank's shards.

    With tensor parallelism the gradients are DTensors on two meshes ((dp, tp) for the split layers, dp for the ones
    kept whole), which torch.nn.utils.clip_grad_norm_ cannot mix: each mesh's gradients are reduced and scaled apart.
    """
    groups: dict[object, list[nn.Parameter]] = {}  # the parameters by the mesh their gradients live on
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
'''
    + SQUARES_PER_MESH
    + """    total = torch.stack(squares).sum().sqrt()
"""
    + CLIP_BY_TOTAL
)
