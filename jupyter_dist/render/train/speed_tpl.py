"""Templates: execution speed, as jupyter-dist's workers run it (issue 31).

The fused optimizer, regional compilation of the blocks and FP8 training through torchao: the generated script's
copies of :mod:`jupyter_dist.worker._speed` and :mod:`jupyter_dist.worker._float8` (``tests/test_render_speed.py``
runs both on the same model and compares what they do).
"""

from __future__ import annotations

__all__ = ["ARGS_SPEED", "ARGS_FUSED", "ARGS_FP8", "ON_CUDA", "COMPILE_BLOCKS", "FLOAT8", "FP8_RECIPES"]

FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 scalings ``--fp8-recipe`` takes (the worker's ``JD_FP8_RECIPE`` values)."""

ARGS_SPEED = """
parser.add_argument(
    "--compile", action=argparse.BooleanOptionalAction, default=None,
    help="torch.compile each block (default: on CUDA); a compiler error falls back to eager",
)
"""

ARGS_FUSED = """
parser.add_argument(
    "--fused", action=argparse.BooleanOptionalAction, default=None,
    help="the optimizer's fused implementation: the same update in one kernel (default: on CUDA)",
)
"""

ARGS_FP8 = """
parser.add_argument(
    "--fp8-recipe", choices=FP8_RECIPES, default=FP8_RECIPE, help="float8 scaling: one scale per tensor or per row"
)
parser.add_argument(
    "--fp8-emulate", action="store_true", help="emulate FP8 where the GPU has none (tests: high-precision matmuls)"
)
"""

ON_CUDA = '''
def on_cuda(flag: bool | None) -> bool:
    """A --compile / --fused value: as given, or (neither given) on CUDA only, as jupyter-dist's workers."""
    return torch.cuda.is_available() if flag is None else flag
'''

COMPILE_BLOCKS = '''
def compile_blocks(model: nn.Module, enabled: bool) -> None:
    """torch.compile each BLOCK_CLASS in place (regional compilation, torchtitan's apply_compile).

    After tensor parallelism and activation checkpointing, before the data-parallel wrapper. Parameter names do
    not change. A compiler error (at the first call, where the backward is compiled with the forward) turns every
    block back to eager, and rank 0 prints one line naming it.
    """
    blocks = [module for module in model.modules() if isinstance(module, BLOCK_CLASS)] if enabled else []
    failed: list[BaseException] = []

    def fall_back(error: BaseException) -> None:
        if failed:
            return
        failed.append(error)
        for block in blocks:
            block._compiled_call_impl = None
        if dist.get_rank() == 0:
            first = (str(error).strip().splitlines() or [""])[0][:300]
            print(f"torch.compile of the blocks failed ({type(error).__name__}: {first}); they run eager", flush=True)

    def guarded(block: nn.Module, compiled: Any) -> Any:
        ran: list[bool] = []

        def call(*args: Any, **kwargs: Any) -> Any:
            if failed:
                return block._call_impl(*args, **kwargs)
            try:
                if ran:
                    return compiled(*args, **kwargs)
                # compile the backward now too (else lazily at the first backward, where eager cannot take over)
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    out = compiled(*args, **kwargs)
                ran.append(True)
                return out
            except Exception as error:  # any compiler error: eager is the same math
                fall_back(error)
                return block._call_impl(*args, **kwargs)

        return call

    try:
        for block in blocks:
            block._compiled_call_impl = guarded(block, torch.compile(block._call_impl))
    except Exception as error:  # a compiler that cannot start
        fall_back(error)
'''

FLOAT8 = '''
def convert_float8(model: nn.Module, args: argparse.Namespace) -> None:
    """fp8: the blocks' linear layers become torchao's Float8Linear (dynamic scaling, --fp8-recipe).

    torchtitan's float8 recipe: the first and last layers (the embeddings and the head, outside the blocks) and any
    linear whose dimensions are not multiples of 16 stay in bf16, as does everything else (bf16 mixed precision
    around them). Without torch.compile FP8 is slower than bf16 (0.45x, measured on an H100).
    <<all_gather_doc>>
    """
    if not args.fp8_emulate:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        if capability is None or capability < (8, 9):
            where = "a CPU" if capability is None else f"a GPU of CUDA capability {capability[0]}.{capability[1]}"
            raise SystemExit(
                "precision fp8 needs a GPU with FP8 matmuls (CUDA capability >= 8.9: H100, H200, L4, ...), not "
                f"{where}; use bf16-mixed (--fp8-emulate emulates FP8 for tests)"
            )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise SystemExit("precision fp8 needs torchao: pip install torchao") from err
    config = Float8LinearConfig.from_recipe_name(args.fp8_recipe)
    <<config>>
    inside = {
        id(linear)
        for block in model.modules() if isinstance(block, BLOCK_CLASS)
        for linear in block.modules() if type(linear) is nn.Linear
    }

    def eligible(module: nn.Module, name: str) -> bool:
        return id(module) in inside and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    converted = sum(type(module).__name__ == "Float8Linear" for module in model.modules())
    if dist.get_rank() == 0:
        kept = len(inside) - converted
        print(
            f"fp8 ({args.fp8_recipe}{', emulated' * args.fp8_emulate}) of {converted} linear layers in the blocks"
            f"{f' ({kept} kept in bf16: dimensions not multiples of 16)' if kept else ''}; the rest in bf16",
            flush=True,
        )
'''
