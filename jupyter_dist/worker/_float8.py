"""``JD_PRECISION=fp8``: FP8 training of the repeated blocks' linear layers through torchao (issue 31).

torchtitan's float8 converter, read, not copied: ``torchao.float8.convert_to_float8_training`` swaps the
``nn.Linear`` layers of the blocks for ``Float8Linear`` (dynamic scaling, ``tensorwise`` by default or ``rowwise``,
``JD_FP8_RECIPE``); the first and last layers (outside the blocks: embeddings, the head) and any linear whose
dimensions are not multiples of 16 stay in bf16, as does everything else (bf16 mixed precision around them). Under
FSDP2 with tensorwise scaling the weights are all-gathered in float8. It runs where the hardware has FP8 (CUDA
capability >= 8.9: H100, H200, L4, ...) and refuses elsewhere in one line, unless torchao's emulation is asked
(``JD_FP8_EMULATE=1``, for tests on CPU: the same scaling and casts, the matmul in high precision). Without
``torch.compile`` FP8 is slower than bf16 (measured on an H100: 0.45x), which is why :mod:`._speed` compiles the blocks
on CUDA by default.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..plan.training import fp8_strategy_problem
from ._env import FP8_RECIPES, WorkerEnv, WorkerError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["FP8_RECIPES", "FP8_MIN_CAPABILITY", "convert_float8", "float8_problem"]

_log = logging.getLogger("jupyter_dist.worker")

FP8_MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability from which a GPU multiplies in FP8 (Ada, Hopper and later)."""

_MULTIPLE = 16
"""FP8 matmuls need both dimensions of the weight to be multiples of 16."""


def float8_problem(env: WorkerEnv, device: torch.device) -> str | None:
    """Why ``JD_PRECISION=fp8`` cannot run here (one line), or ``None``."""
    if env.fp8_emulate:
        return None
    if device.type == "cuda":
        import torch

        cap = torch.cuda.get_device_capability(device)
        if cap >= FP8_MIN_CAPABILITY:
            return None
        where = f"{torch.cuda.get_device_name(device)} (CUDA capability {cap[0]}.{cap[1]})"
    else:
        where = f"this {device.type} device"
    return (f"JD_PRECISION=fp8 needs a GPU with FP8 matmuls (CUDA capability >= 8.9: H100, H200, L4, ...), not "
            f"{where}; use bf16-mixed (JD_FP8_EMULATE=1 emulates FP8 for tests)")  # fmt: skip


def convert_float8(env: WorkerEnv, model: torch.nn.Module, blocks: list[Any], device: torch.device, *,
                   family: str) -> list[str]:  # fmt: skip
    """Swap the blocks' eligible ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear`` in place.

    Answers the names of the converted modules (empty unless ``JD_PRECISION=fp8``).
    """
    if env.precision != "fp8":
        return []
    problem = float8_problem(env, device)
    if problem is not None:
        raise WorkerError(problem)
    strategy_problem = fp8_strategy_problem(family, env.tp)  # the planner marks the same candidates
    if strategy_problem is not None:
        raise WorkerError(f"JD_PRECISION={strategy_problem}")
    if not blocks:
        raise WorkerError("JD_PRECISION=fp8 converts the linear layers of the model's repeated blocks (a ModuleList "
                          "or ModuleDict of one class), and this model has none; use bf16-mixed")  # fmt: skip
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(f"JD_PRECISION=fp8 needs torchao: pip install 'jupyter-dist[fp8]' ({e})") from e
    import dataclasses

    import torch.nn as nn

    config = Float8LinearConfig.from_recipe_name(env.fp8_recipe)
    changes: dict[str, Any] = {"emulate": env.fp8_emulate}
    if family == "fsdp2" and env.fp8_recipe == "tensorwise":
        changes["enable_fsdp_float8_all_gather"] = True
    config = dataclasses.replace(config, **changes)
    inside = {id(m) for b in blocks for m in b.modules() if type(m) is nn.Linear}

    def eligible(module: nn.Module, name: str) -> bool:
        return (id(module) in inside and module.in_features % _MULTIPLE == 0
                and module.out_features % _MULTIPLE == 0)  # fmt: skip

    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    if env.rank == 0:
        kept = len(inside) - len(converted)
        _log.warning("jd.wrap: fp8 (%s%s) of %d linear layers in the blocks%s; the rest in bf16", env.fp8_recipe,
                     ", emulated" * env.fp8_emulate, len(converted),
                     f" ({kept} kept in bf16: dimensions not multiples of 16)" if kept else "")  # fmt: skip
    return converted
