"""Accelerator and interconnect catalog, and the :class:`Hardware` a plan runs on (stdlib only).

Figures are the vendors' datasheet numbers, dense (no structured sparsity):

* NVIDIA V100 datasheet (SXM2): 125 TFLOPS fp16 tensor, no bf16, NVLink 2 at 300 GB/s bidirectional.
* NVIDIA DGX-2 datasheet: 16 V100 32GB on NVSwitch (each GPU's six NVLink 2 links, 300 GB/s bidirectional, to every
  other GPU of the node), 8 x 100 Gb/s InfiniBand EDR per node: ``gpus_per_node=16``, ``infiniband-edr``.
* NVIDIA A10 datasheet: 125 TFLOPS bf16/fp16 dense (A10G, AWS's variant of the A10, is the same class; 24 GB).
* NVIDIA L4 datasheet: 121 TFLOPS bf16/fp16 dense (242 with sparsity), PCIe Gen4 x16.
* NVIDIA A100 datasheet: 312 TFLOPS bf16/fp16 dense, NVLink 3 at 600 GB/s bidirectional.
* NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16/fp16 dense (1,979 with sparsity), NVLink 4 at 900 GB/s
  bidirectional; H100 PCIe: 756 TFLOPS, PCIe Gen5 (NVLink bridge pairs only).
* NVIDIA H200 datasheet: same compute as H100 SXM, 141 GB HBM3e.
* AMD Instinct MI300X datasheet: 1,307.4 TFLOPS bf16/fp16 dense, 192 GB HBM3, 7 Infinity Fabric links of 64 GB/s
  per direction (448 GB/s to the seven peers).

Memory is what ``nvidia-smi`` reports as the device total (MiB), which is what the allocator can use before the CUDA
context is taken out; bandwidths are stored per GPU per direction in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import PlanInputError, UnknownAcceleratorError
from .units import GiB, MiB, close_match_hint

__all__ = [
    "Accelerator",
    "Interconnect",
    "Hardware",
    "ACCELERATORS",
    "INTERCONNECTS",
    "get_accelerator",
    "get_interconnect",
    "register_accelerator",
    "fp8_problem",
]

_GBs = 10**9  # GB/s as bytes/s
_TFLOPS = 1e12


@dataclass(frozen=True, kw_only=True, slots=True)
class Accelerator:
    """One accelerator model: memory, peak dense throughput and its links."""

    name: str
    """Catalog key, lower case, e.g. ``"h100-80gb"``."""
    label: str
    """Human name, e.g. ``"NVIDIA H100 80GB SXM"``."""
    memory_bytes: int
    """Device memory in bytes as the driver reports it."""
    bf16_flops: float
    """Peak dense bf16 tensor throughput (FLOP/s); 0 where bf16 is not supported in hardware."""
    fp16_flops: float
    """Peak dense fp16 tensor throughput (FLOP/s)."""
    fp32_flops: float
    """Peak fp32 throughput (FLOP/s), without TF32 tensor cores."""
    intra_node_bw: float
    """Per-GPU, per-direction bandwidth to the other GPUs of its node (bytes/s): NVLink, Infinity Fabric or PCIe."""
    intra_node_link: str
    """Name of the intra-node link, e.g. ``"NVLink 4"``."""
    host_link_bw: float = 25 * _GBs
    """Per-direction bandwidth between the GPU and host memory (bytes/s), used for CPU offload."""
    max_gpus_per_node: int = 8
    """Largest node size built with this accelerator (16 for V100: NVIDIA's DGX-2 and HGX-2 put 16 on NVSwitch)."""
    default_gpus_per_node: int = 0
    """The node size a plan assumes when none is given; 0: :attr:`max_gpus_per_node` (V100: 8, the DGX-1)."""
    default_interconnect: str = "ethernet-100"
    """Key of the inter-node network such nodes usually have (see :data:`INTERCONNECTS`)."""
    node_cpu_memory_bytes: int = 1024 * GiB
    """Host memory of a typical node with this accelerator (bytes), the budget for CPU offload."""
    vendor: str = "nvidia"
    """``"nvidia"`` (CUDA, NCCL) or ``"amd"`` (ROCm, RCCL)."""
    fp8_flops: float = 0.0
    """Peak dense FP8 tensor throughput (FLOP/s), half the datasheets' "with sparsity" figure; 0 where the GPU has no
    FP8 tensor cores (A100, V100, A10G, CPU), which the planner refuses ``fp8`` for (:func:`fp8_problem`). NVIDIA's
    datasheets: H100 SXM 3,958 and H100 PCIe 3,026 TFLOPS "with sparsity" (H100 Tensor Core GPU datasheet), H200 SXM
    3,958 (H200 datasheet), L4 485 (L4 datasheet)."""
    memory_bw: float = 2.0e12
    """Device memory (HBM/GDDR) bandwidth, bytes/s (datasheet): the rate of memory-bound elementwise work."""
    matmul_efficiency: float = 0.5
    """Fraction of the dense peak that a training step's matrix multiplies reach at width 8192, or the calibrated one
    measured by ``%dist_tune``. From published GEMM rates and measured utilisation on that GPU: A100 0.60
    (Korthikanti et al. 2022, arXiv:2205.05198, Table 5: 56-57 % HFU for the 530B/1T runs end to end, so the GEMMs
    themselves run at ~60 %; Narayanan et al. 2021 reach 52 % with full recomputation); H100 and H200 0.60: the low
    end of cuBLAS's bf16 rate on an H100 SXM at training shapes (600-750 of 989 TFLOP/s at M = 8192, K, N =
    2048-8192); it puts Llama 3 405B (Dubey et al. 2024, Table 4: 430 / 400 TFLOP/s per GPU on 8k / 16k H100s) at
    1.06 / 1.07 of measured and issue 31's 1.4B GPT-2-style model on one H100 at 0.91-0.96, whose step less its
    attention, elementwise and optimizer parts leaves 550-585 TFLOP/s for the matmuls (the former 0.50, backed out
    of Llama 3's MFU before :mod:`jupyter_dist.plan.perf` priced those parts, the bubble and communication itself,
    charged them twice: 420 TFLOP/s, the 1.4B eager step 230 ms against 192, Llama 3 at 0.92 / 0.93); V100 0.45
    (Shoeybi et al. 2019: 39 TFLOP/s on one V100, 30 % of peak, whole step); MI300X 0.40 and the PCIe/Ada parts
    0.50 are estimates."""
    op_overhead_s: float = 5e-6
    """Seconds of host-side cost per operator (CUDA kernel launch ~5 us; eager CPU dispatch): bounds tiny models."""
    collective_latency_s: float = 2e-5
    """Seconds one collective costs before its bytes count (launch, handshake, the ring's first hop): what bounds a
    small model's many per-layer all-gathers. GPUs: the flat small-message rows of nccl-tests (tens of us inside a
    node); CPU processes: gloo over loopback TCP, 0.3-1.8 ms per all-reduce / all-gather / reduce-scatter of 16 to
    65,536 floats between two ranks on a 2-core machine (docs/recipes.md). ``%dist_tune``'s ``comm_scale`` corrects
    it with the bandwidths."""
    comm_scale: float = 1.0
    """Measured over modelled collective time on this hardware (a calibration; 1: the catalog's bandwidths)."""
    calibration: str = ""
    """Where :attr:`matmul_efficiency`, :attr:`op_overhead_s` and :attr:`comm_scale` come from when measured
    (``%dist_tune``'s calibration file); empty: the published figures."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise PlanInputError(f"accelerator {self.name!r}: memory_bytes must be positive, got {self.memory_bytes}")
        if max(self.bf16_flops, self.fp16_flops, self.fp32_flops) <= 0:
            raise PlanInputError(f"accelerator {self.name!r}: give at least one positive peak throughput")
        if self.intra_node_bw <= 0 or self.host_link_bw <= 0:
            raise PlanInputError(f"accelerator {self.name!r}: bandwidths must be positive")
        if self.max_gpus_per_node < 1:
            raise PlanInputError(f"accelerator {self.name!r}: max_gpus_per_node must be >= 1")
        if not 0 <= self.default_gpus_per_node <= self.max_gpus_per_node:
            raise PlanInputError(f"accelerator {self.name!r}: default_gpus_per_node must be in "
                                 f"0..{self.max_gpus_per_node} (0: max_gpus_per_node)")  # fmt: skip

    @property
    def node_gpus(self) -> int:
        """GPUs per node when none is given (:attr:`default_gpus_per_node`, else :attr:`max_gpus_per_node`)."""
        return self.default_gpus_per_node or self.max_gpus_per_node
        if self.memory_bw <= 0 or self.op_overhead_s < 0 or self.comm_scale <= 0 or self.collective_latency_s < 0:
            raise PlanInputError(
                f"accelerator {self.name!r}: memory_bw and comm_scale must be positive, op_overhead_s and "
                "collective_latency_s >= 0"
            )
        if not 0 < self.matmul_efficiency <= 1:
            raise PlanInputError(
                f"accelerator {self.name!r}: matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}"
            )

    @property
    def latency_s(self) -> float:
        """:attr:`collective_latency_s` as calibrated (``comm_scale`` scales a collective's latency with its bytes)."""
        return self.collective_latency_s * self.comm_scale

    def peak_flops(self, dtype: str) -> float:
        """Peak dense throughput for ``"fp8"``, ``"bf16"``, ``"fp16"`` or ``"fp32"`` compute (FLOP/s)."""
        if dtype == "fp8":
            problem = fp8_problem(self)
            if problem:
                raise PlanInputError(problem)
            return self.fp8_flops
        value = {"bf16": self.bf16_flops, "fp16": self.fp16_flops, "fp32": self.fp32_flops}[dtype]
        return value if value > 0 else self.fp32_flops

    @property
    def supports_fp8(self) -> bool:
        """Whether the accelerator has FP8 tensor cores (:attr:`fp8_flops`)."""
        return self.fp8_flops > 0

    @property
    def supports_bf16(self) -> bool:
        """Whether the accelerator has bf16 tensor cores."""
        return self.bf16_flops > 0

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready dict (bytes and FLOP/s as numbers)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Accelerator:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Interconnect:
    """An inter-node network, as the aggregate bandwidth of one node's NICs."""

    name: str
    """Catalog key, e.g. ``"infiniband-ndr"``."""
    label: str
    """Human name, e.g. ``"InfiniBand NDR, 8 x 400 Gb/s"``."""
    node_bw: float
    """Aggregate per-direction bandwidth of one node's network (bytes/s)."""
    efficiency: float = 0.8
    """Fraction of :attr:`node_bw` that large NCCL collectives reach (nccl-tests bus bandwidth / line rate)."""
    fast: bool = True
    """RDMA-class fabric (InfiniBand, RoCE, EFA) fit for multi-node sharded training."""

    def __post_init__(self) -> None:
        if self.node_bw <= 0:
            raise PlanInputError(f"interconnect {self.name!r}: node_bw must be positive")
        if not 0 < self.efficiency <= 1:
            raise PlanInputError(f"interconnect {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready dict."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Interconnect:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)  # type: ignore[arg-type]


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect(name="infiniband-ndr", label="InfiniBand NDR, 8 x 400 Gb/s per node", node_bw=_gbit(3200)),
        Interconnect(name="infiniband-hdr", label="InfiniBand HDR, 8 x 200 Gb/s per node", node_bw=_gbit(1600)),
        Interconnect(name="infiniband-edr", label="InfiniBand EDR, 8 x 100 Gb/s per node (DGX-2)", node_bw=_gbit(800)),
        Interconnect(name="roce-400", label="RoCE v2, 8 x 400 Gb/s per node", node_bw=_gbit(3200), efficiency=0.75),
        Interconnect(name="efa-3200", label="AWS EFA v2, 3,200 Gb/s per node (p5)", node_bw=_gbit(3200),
                     efficiency=0.7),
        Interconnect(name="efa-400", label="AWS EFA, 400 Gb/s per node (p4d)", node_bw=_gbit(400), efficiency=0.7),
        Interconnect(name="ethernet-100", label="Ethernet (TCP), 100 Gb/s per node", node_bw=_gbit(100),
                     efficiency=0.6, fast=False),
        Interconnect(name="ethernet-25", label="Ethernet (TCP), 25 Gb/s per node", node_bw=_gbit(25),
                     efficiency=0.6, fast=False),
        Interconnect(name="ethernet-10", label="Ethernet (TCP), 10 Gb/s per node", node_bw=_gbit(10),
                     efficiency=0.6, fast=False),
    )
}  # fmt: skip


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(name="v100-16gb", label="NVIDIA V100 16GB SXM2", memory_bytes=16384 * MiB,
                    bf16_flops=0, fp16_flops=125 * _TFLOPS, fp32_flops=15.7 * _TFLOPS,
                    intra_node_bw=150 * _GBs, intra_node_link="NVLink 2", host_link_bw=12 * _GBs,
                    default_interconnect="ethernet-100", max_gpus_per_node=16,
                    default_gpus_per_node=8, node_cpu_memory_bytes=488 * GiB,
                    memory_bw=900 * _GBs, matmul_efficiency=0.45, op_overhead_s=5e-6),
        Accelerator(name="v100-32gb", label="NVIDIA V100 32GB SXM2", memory_bytes=32768 * MiB,
                    bf16_flops=0, fp16_flops=125 * _TFLOPS, fp32_flops=15.7 * _TFLOPS,
                    intra_node_bw=150 * _GBs, intra_node_link="NVLink 2", host_link_bw=12 * _GBs,
                    default_interconnect="ethernet-100", max_gpus_per_node=16,
                    default_gpus_per_node=8, node_cpu_memory_bytes=768 * GiB,
                    memory_bw=900 * _GBs, matmul_efficiency=0.45, op_overhead_s=5e-6),
        Accelerator(name="a10g", label="NVIDIA A10G 24GB", memory_bytes=23028 * MiB,
                    bf16_flops=125 * _TFLOPS, fp16_flops=125 * _TFLOPS, fp32_flops=31.2 * _TFLOPS,
                    intra_node_bw=25 * _GBs, intra_node_link="PCIe Gen4 x16", host_link_bw=25 * _GBs,
                    default_interconnect="ethernet-100", node_cpu_memory_bytes=768 * GiB,
                    memory_bw=600 * _GBs, matmul_efficiency=0.5, op_overhead_s=5e-6),
        Accelerator(name="l4", label="NVIDIA L4 24GB", memory_bytes=23034 * MiB,
                    bf16_flops=121 * _TFLOPS, fp16_flops=121 * _TFLOPS, fp32_flops=30.3 * _TFLOPS,
                    intra_node_bw=25 * _GBs, intra_node_link="PCIe Gen4 x16", host_link_bw=25 * _GBs,
                    default_interconnect="ethernet-100", node_cpu_memory_bytes=768 * GiB,
                    fp8_flops=242.5 * _TFLOPS, memory_bw=300 * _GBs, matmul_efficiency=0.5, op_overhead_s=5e-6),
        Accelerator(name="a100-40gb", label="NVIDIA A100 40GB SXM4", memory_bytes=40960 * MiB,
                    bf16_flops=312 * _TFLOPS, fp16_flops=312 * _TFLOPS, fp32_flops=19.5 * _TFLOPS,
                    intra_node_bw=300 * _GBs, intra_node_link="NVLink 3", host_link_bw=25 * _GBs,
                    default_interconnect="efa-400", node_cpu_memory_bytes=1152 * GiB,
                    memory_bw=1555 * _GBs, matmul_efficiency=0.6, op_overhead_s=5e-6),
        Accelerator(name="a100-80gb", label="NVIDIA A100 80GB SXM4", memory_bytes=81920 * MiB,
                    bf16_flops=312 * _TFLOPS, fp16_flops=312 * _TFLOPS, fp32_flops=19.5 * _TFLOPS,
                    intra_node_bw=300 * _GBs, intra_node_link="NVLink 3", host_link_bw=25 * _GBs,
                    default_interconnect="infiniband-hdr", node_cpu_memory_bytes=1152 * GiB,
                    memory_bw=2039 * _GBs, matmul_efficiency=0.6, op_overhead_s=5e-6),
        Accelerator(name="h100-pcie", label="NVIDIA H100 80GB PCIe", memory_bytes=81559 * MiB,
                    bf16_flops=756 * _TFLOPS, fp16_flops=756 * _TFLOPS, fp32_flops=51 * _TFLOPS,
                    intra_node_bw=50 * _GBs, intra_node_link="PCIe Gen5 x16", host_link_bw=50 * _GBs,
                    default_interconnect="ethernet-100", node_cpu_memory_bytes=1024 * GiB,
                    fp8_flops=1513 * _TFLOPS, memory_bw=2000 * _GBs, matmul_efficiency=0.5, op_overhead_s=5e-6),
        Accelerator(name="h100-80gb", label="NVIDIA H100 80GB SXM5", memory_bytes=81559 * MiB,
                    bf16_flops=989 * _TFLOPS, fp16_flops=989 * _TFLOPS, fp32_flops=67 * _TFLOPS,
                    intra_node_bw=450 * _GBs, intra_node_link="NVLink 4", host_link_bw=50 * _GBs,
                    default_interconnect="infiniband-ndr", node_cpu_memory_bytes=2048 * GiB,
                    fp8_flops=1979 * _TFLOPS, memory_bw=3350 * _GBs, matmul_efficiency=0.6, op_overhead_s=5e-6),
        Accelerator(name="h200", label="NVIDIA H200 141GB SXM5", memory_bytes=143771 * MiB,
                    bf16_flops=989 * _TFLOPS, fp16_flops=989 * _TFLOPS, fp32_flops=67 * _TFLOPS,
                    intra_node_bw=450 * _GBs, intra_node_link="NVLink 4", host_link_bw=50 * _GBs,
                    default_interconnect="infiniband-ndr", node_cpu_memory_bytes=2048 * GiB,
                    fp8_flops=1979 * _TFLOPS, memory_bw=4800 * _GBs, matmul_efficiency=0.6, op_overhead_s=5e-6),
        # A CPU process with gloo, for local runs and tests: 16 GiB and ~1 TFLOPS are placeholders, not a measurement.
        Accelerator(name="cpu", label="CPU process (gloo)", memory_bytes=16 * GiB, bf16_flops=0, fp16_flops=0,
                    fp32_flops=1e12, intra_node_bw=10 * _GBs, intra_node_link="shared memory",
                    host_link_bw=10 * _GBs, max_gpus_per_node=256, default_interconnect="ethernet-10",
                    node_cpu_memory_bytes=16 * GiB, vendor="cpu",
                    memory_bw=20 * _GBs, matmul_efficiency=0.5, op_overhead_s=2e-5, collective_latency_s=5e-4),
        Accelerator(name="mi300x", label="AMD Instinct MI300X 192GB", memory_bytes=192 * GiB,
                    bf16_flops=1307.4 * _TFLOPS, fp16_flops=1307.4 * _TFLOPS, fp32_flops=163.4 * _TFLOPS,
                    intra_node_bw=448 * _GBs, intra_node_link="Infinity Fabric", host_link_bw=50 * _GBs,
                    default_interconnect="infiniband-ndr", node_cpu_memory_bytes=2048 * GiB, vendor="amd",
                    memory_bw=5300 * _GBs, matmul_efficiency=0.4, op_overhead_s=5e-6),
    )
}  # fmt: skip

_ALIASES = {
    "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h100-80gb-sxm": "h100-80gb", "a100": "a100-80gb",
    "a100-80": "a100-80gb", "a100-40": "a100-40gb", "v100": "v100-32gb", "h200-141gb": "h200",
    "a10": "a10g", "mi300": "mi300x",
}  # fmt: skip


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_accelerator(name: str | Accelerator) -> Accelerator:
    """Look an accelerator up by catalog name or alias (``"h100"``, ``"A100-80GB"``)."""
    if isinstance(name, Accelerator):
        return name
    key = _normalise(name)
    key = _ALIASES.get(key, key)
    if key not in ACCELERATORS:
        choices = sorted(ACCELERATORS)
        raise UnknownAcceleratorError(
            f"unknown GPU {name!r}{close_match_hint(key, choices + list(_ALIASES))}; "
            f"valid: {', '.join(choices)} (or register_accelerator() for a custom one)"
        )
    return ACCELERATORS[key]


def get_interconnect(name: str | Interconnect) -> Interconnect:
    """Look an inter-node network up by catalog name."""
    if isinstance(name, Interconnect):
        return name
    key = _normalise(name)
    if key not in INTERCONNECTS:
        choices = sorted(INTERCONNECTS)
        raise UnknownAcceleratorError(
            f"unknown interconnect {name!r}{close_match_hint(key, choices)}; valid: {', '.join(choices)}"
        )
    return INTERCONNECTS[key]


def register_accelerator(accelerator: Accelerator, *, replace_existing: bool = False) -> Accelerator:
    """Add a custom accelerator to the catalog so it can be named in plans, the CLI and the wizard."""
    key = _normalise(accelerator.name)
    if key in ACCELERATORS and not replace_existing:
        raise PlanInputError(f"accelerator {key!r} is already in the catalog; pass replace_existing=True")
    ACCELERATORS[key] = replace(accelerator, name=key)
    return ACCELERATORS[key]


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """The machines a job runs on: an accelerator, how many per node, how many nodes, and the network."""

    accelerator: Accelerator
    """The accelerator model (see :func:`get_accelerator`)."""
    gpus_per_node: int = 8
    """Accelerators per node (1..accelerator.max_gpus_per_node)."""
    nodes: int = 1
    """Number of nodes (>= 1)."""
    interconnect: Interconnect = field(default_factory=lambda: INTERCONNECTS["infiniband-ndr"])
    """Inter-node network; only matters when ``nodes > 1``."""
    intra_node_efficiency: float = 0.8
    """Fraction of the intra-node link rate that large collectives reach (nccl-tests bus bandwidth)."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise PlanInputError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.gpus_per_node > self.accelerator.max_gpus_per_node:
            raise PlanInputError(
                f"gpus_per_node {self.gpus_per_node} exceeds the {self.accelerator.max_gpus_per_node} "
                f"{self.accelerator.label} GPUs a node has; use 1..{self.accelerator.max_gpus_per_node} "
                "and more nodes"
            )
        if self.nodes < 1:
            raise PlanInputError(f"nodes must be >= 1, got {self.nodes}")
        if not 0 < self.intra_node_efficiency <= 1:
            raise PlanInputError(f"intra_node_efficiency must be in (0, 1], got {self.intra_node_efficiency}")

    @classmethod
    def from_names(
        cls, gpu: str | Accelerator = "h100-80gb", *, gpus_per_node: int | None = None, nodes: int = 1,
        interconnect: str | Interconnect | None = None,
    ) -> Hardware:
        """Build from catalog names; the interconnect defaults to the one such nodes usually have."""
        acc = get_accelerator(gpu)
        ic = get_interconnect(interconnect if interconnect is not None else acc.default_interconnect)
        return cls(accelerator=acc, gpus_per_node=gpus_per_node or acc.node_gpus, nodes=nodes,
                   interconnect=ic)  # fmt: skip

    @property
    def world_size(self) -> int:
        """Total number of accelerators."""
        return self.gpus_per_node * self.nodes

    @property
    def unit(self) -> str:
        """What one rank runs on, in the plan's words: ``"GPU"``, or ``"process"`` for CPU processes."""
        return "process" if self.accelerator.vendor == "cpu" else "GPU"

    @property
    def unit_plural(self) -> str:
        """``"GPUs"`` or ``"processes"``."""
        return "processes" if self.unit == "process" else "GPUs"

    def units(self, n: int) -> str:
        """``"2 GPUs"`` / ``"1 GPU"`` / ``"2 processes"``."""
        if self.unit == "process":
            return f"{n} process{'es' if n != 1 else ''}"
        return f"{n} GPU{'s' if n != 1 else ''}"

    def collective_bw(self, group_size: int, *, ranks_per_node: int | None = None) -> float:
        """Bus bandwidth (bytes/s) a collective over ``group_size`` ranks reaches, nccl-tests style.

        A group inside one node runs over the intra-node link. A group that spans nodes is limited by the
        network: with ``ranks_per_node`` of its ranks on each node, and the other groups of that node sharing
        the NICs, it gets ``node_bw * ranks_per_node / gpus_per_node`` (rail-optimised rings, one NIC per GPU).
        """
        if group_size <= 1:
            return float("inf")
        intra = self.accelerator.intra_node_bw * self.intra_node_efficiency / self.accelerator.comm_scale
        per_node = min(ranks_per_node or group_size, self.gpus_per_node)
        if group_size <= per_node or self.nodes == 1:
            return intra
        inter = self.interconnect.node_bw * self.interconnect.efficiency * per_node / self.gpus_per_node
        return min(intra, inter / self.accelerator.comm_scale)

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready dict."""
        return {
            "accelerator": self.accelerator.to_dict(),
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "interconnect": self.interconnect.to_dict(),
            "intra_node_efficiency": self.intra_node_efficiency,
            "world_size": self.world_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Hardware:
        """Inverse of :meth:`to_dict`."""
        return cls(
            accelerator=Accelerator.from_dict(data["accelerator"]),  # type: ignore[arg-type]
            gpus_per_node=int(data["gpus_per_node"]),  # type: ignore[call-overload]
            nodes=int(data["nodes"]),  # type: ignore[call-overload]
            interconnect=Interconnect.from_dict(data["interconnect"]),  # type: ignore[arg-type]
            intra_node_efficiency=float(data.get("intra_node_efficiency", 0.8)),  # type: ignore[arg-type]
        )


def fp8_problem(acc: Accelerator) -> str | None:
    """Why ``acc`` cannot train in ``fp8`` (one line naming the catalog's GPUs that can), or ``None``."""
    if acc.supports_fp8:
        return None
    having = ", ".join(a.name for a in ACCELERATORS.values() if a.supports_fp8)
    return f"precision fp8 needs FP8 tensor cores, which {acc.label} lacks; GPUs with them: {having}"
