"""The planning core: pure, stdlib only (no torch, IPython, widgets or plotting at import time).

``plan(model, hardware, training)`` answers which strategy, whether it fits, how fast, and why.
"""

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
    "ACCELERATORS", "INTERCONNECTS", "PRESETS", "STRATEGIES", "Accelerator", "Assumptions", "Candidate",
    "Checkpointing", "Hardware", "Interconnect", "MemoryBreakdown", "ModelSpec", "OptimizerKind", "ParallelDims",
    "Plan", "Precision", "StepTime", "StrategySpec", "TrainingShape", "get_accelerator", "get_preset",
    "get_strategy", "plan", "preset_names", "strategy_names",
]  # fmt: skip
