"""The planning core: pure, stdlib only (no torch, IPython, widgets or plotting at import time).

``plan(model, hardware, training)`` answers which strategy, whether it fits, how fast, and why. This subpackage is
itself callable, ``jupyter_dist.plan("llama-3-8b")`` is ``jupyter_dist.plan.plan("llama-3-8b")``, so the package
attribute and the planner never shadow each other (whichever is imported first).
"""

import sys
import types
from typing import Any

from .candidates import RUNNABLE, CandidateName, LaunchChoice, parse_candidate, resolve_launch, runnable_problem
from .hardware import ACCELERATORS, INTERCONNECTS, Accelerator, Hardware, Interconnect, get_accelerator
from .memory import Assumptions, MemoryBreakdown
from .model import PRESETS, ModelSpec, get_preset, preset_names
from .parallel import ParallelDims
from .perf import StepTime
from .plan import Candidate, Plan
from .planner import plan
from .strategies import STRATEGIES, StrategySpec, get_strategy, strategy_names
from .training import Checkpointing, OptimizerKind, Precision, TrainingShape

__all__ = [
    "ACCELERATORS", "INTERCONNECTS", "PRESETS", "RUNNABLE", "STRATEGIES", "Accelerator", "Assumptions", "Candidate",
    "CandidateName", "Checkpointing", "Hardware", "Interconnect", "LaunchChoice", "MemoryBreakdown", "ModelSpec",
    "OptimizerKind", "ParallelDims", "Plan", "Precision", "StepTime", "StrategySpec", "TrainingShape",
    "get_accelerator", "get_preset", "get_strategy", "parse_candidate", "plan", "preset_names", "resolve_launch",
    "runnable_problem", "strategy_names",
]  # fmt: skip


class _CallablePackage(types.ModuleType):
    """The class of this module: calling the package calls :func:`~jupyter_dist.plan.planner.plan`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
