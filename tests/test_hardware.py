"""Accelerator / interconnect catalog and the Hardware value object."""

from __future__ import annotations

import pytest

from jupyter_dist.errors import PlanInputError, UnknownAcceleratorError
from jupyter_dist.plan import ACCELERATORS, Accelerator, Hardware, get_accelerator, plan
from jupyter_dist.plan.hardware import INTERCONNECTS, get_interconnect, register_accelerator
from jupyter_dist.plan.units import GiB, MiB, parse_bytes, parse_count

REQUIRED = ["v100-32gb", "a10g", "l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "mi300x"]


@pytest.mark.parametrize("name", REQUIRED)
def test_catalog_has_the_common_accelerators(name: str) -> None:
    acc = get_accelerator(name)
    assert acc.memory_bytes > 15 * GiB and acc.fp16_flops > 0 and acc.intra_node_bw > 0
    assert acc.default_interconnect in INTERCONNECTS


def test_datasheet_figures() -> None:
    # NVIDIA H100 SXM5: 989 TFLOPS dense bf16, NVLink 4 900 GB/s bidirectional; nvidia-smi reports 81559 MiB
    h100 = get_accelerator("H100")
    assert h100.bf16_flops == 989e12 and h100.intra_node_bw == 450e9 and h100.memory_bytes == 81559 * MiB
    assert get_accelerator("a100-80gb").bf16_flops == 312e12  # A100 datasheet
    assert get_accelerator("mi300x").bf16_flops == pytest.approx(1307.4e12)  # MI300X datasheet
    assert not get_accelerator("v100").supports_bf16  # Volta has fp16 tensor cores only
    assert get_accelerator("v100").peak_flops("bf16") == get_accelerator("v100").fp32_flops


def test_unknown_names_list_valid_ones() -> None:
    hint = r"unknown GPU 'h1000' \(did you mean 'h100'\?\); valid: a100-40gb"
    with pytest.raises(UnknownAcceleratorError, match=hint):
        get_accelerator("h1000")
    with pytest.raises(UnknownAcceleratorError, match="unknown interconnect 'ib'; valid: efa-3200"):
        get_interconnect("ib")


def test_custom_accelerator_can_be_registered_and_planned_with() -> None:
    acc = Accelerator(name="My-GPU-48", label="Custom 48GB", memory_bytes=48 * GiB, bf16_flops=200e12,
                      fp16_flops=200e12, fp32_flops=50e12, intra_node_bw=100e9, intra_node_link="PCIe")  # fmt: skip
    try:
        registered = register_accelerator(acc)
        assert registered.name == "my-gpu-48" and get_accelerator("my-gpu-48") is registered
        p = plan("gpt2", Hardware.from_names("my-gpu-48", gpus_per_node=4))
        assert p.hardware.accelerator.memory_bytes == 48 * GiB and p.world_size == 4
        with pytest.raises(PlanInputError, match="already in the catalog"):
            register_accelerator(acc)
    finally:
        ACCELERATORS.pop("my-gpu-48", None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_bytes": 0}, "memory_bytes must be positive"),
        ({"bf16_flops": 0, "fp16_flops": 0, "fp32_flops": 0}, "at least one positive peak"),
        ({"intra_node_bw": -1}, "bandwidths must be positive"),
        ({"max_gpus_per_node": 0}, "max_gpus_per_node must be >= 1"),
    ],
)
def test_accelerator_validation(kwargs: dict[str, float], message: str) -> None:
    base = {"name": "x", "label": "x", "memory_bytes": GiB, "bf16_flops": 1e12, "fp16_flops": 1e12,
            "fp32_flops": 1e12, "intra_node_bw": 1e9, "intra_node_link": "x"}  # fmt: skip
    with pytest.raises(PlanInputError, match=message):
        Accelerator(**{**base, **kwargs})  # type: ignore[arg-type]


def test_hardware_validation() -> None:
    with pytest.raises(PlanInputError, match="gpus_per_node 16 exceeds the 8"):
        Hardware.from_names("h100", gpus_per_node=16)
    with pytest.raises(PlanInputError, match="nodes must be >= 1, got 0"):
        Hardware.from_names("h100", nodes=0)


def test_collective_bandwidth_intra_vs_inter_node() -> None:
    hw = Hardware.from_names("h100-80gb", nodes=2, interconnect="infiniband-ndr")
    intra = hw.collective_bw(8, ranks_per_node=8)
    assert intra == pytest.approx(450e9 * 0.8)
    # 16 ranks over 2 nodes, 8 per node: the node's 8 x 400 Gb/s = 400 GB/s at 80% efficiency (below NVLink's 360)
    assert hw.collective_bw(16, ranks_per_node=8) == pytest.approx(min(360e9, 400e9 * 0.8))
    # one rank per node shares the NICs with 7 other groups: 1/8 of the node bandwidth
    assert hw.collective_bw(2, ranks_per_node=1) == pytest.approx(400e9 * 0.8 / 8)
    slow = Hardware.from_names("h100-80gb", nodes=2, interconnect="ethernet-25")
    assert slow.collective_bw(16, ranks_per_node=8) < hw.collective_bw(16, ranks_per_node=8) / 50
    assert hw.collective_bw(1) == float("inf")


def test_hardware_round_trip() -> None:
    hw = Hardware.from_names("mi300x", gpus_per_node=4, nodes=3, interconnect="roce-400")
    assert Hardware.from_dict(hw.to_dict()) == hw and hw.world_size == 12


@pytest.mark.parametrize(("text", "value"), [("7B", 7_000_000_000), ("124M", 124_000_000), ("7.5e9", 7_500_000_000),
                                             ("6738415616", 6_738_415_616), (1e6, 1_000_000)])  # fmt: skip
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "value"), [("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("512MiB", 512 * MiB)])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["seven", "-3", "0", "1e"])
def test_parse_count_rejects(bad: str) -> None:
    with pytest.raises(PlanInputError):
        parse_count(bad)


def test_sixteen_gpu_nodes_of_v100_plan_with_their_nvswitch() -> None:
    """A DGX-2 / HGX-2 node holds 16 V100s on NVSwitch (issue 31: 16-GPU nodes were refused): accepted, with the
    tensor-parallel group of 16 inside the node at the NVLink rate; 17 refused in one line naming the valid range; a
    plan that gives no node size still assumes the 8-GPU DGX-1."""
    v100 = get_accelerator("v100-32gb")
    assert (v100.max_gpus_per_node, v100.node_gpus) == (16, 8)
    assert Hardware.from_names("v100-32gb").gpus_per_node == 8
    dgx2 = Hardware.from_names("v100-32gb", gpus_per_node=16, nodes=2, interconnect="infiniband-edr")
    assert dgx2.world_size == 32 and dgx2.interconnect.node_bw == 800e9 / 8
    intra = v100.intra_node_bw * dgx2.intra_node_efficiency
    assert dgx2.collective_bw(16, ranks_per_node=16) == intra  # the whole group on one node's NVSwitch
    assert dgx2.collective_bw(32, ranks_per_node=16) == pytest.approx(800e9 / 8 * dgx2.interconnect.efficiency)
    p = plan("llama-2-7b", dgx2, tp=16)  # 32 heads
    assert p.candidates and all(c.dims.tp == 16 for c in p.candidates)
    with pytest.raises(PlanInputError, match=r"gpus_per_node 17 exceeds the 16 .*V100.*use 1\.\.16"):
        Hardware.from_names("v100-32gb", gpus_per_node=17)
    with pytest.raises(PlanInputError, match=r"gpus_per_node 16 exceeds the 8 .*A100.*use 1\.\.8"):
        Hardware.from_names("a100-80gb", gpus_per_node=16)
    with pytest.raises(PlanInputError, match=r"default_gpus_per_node must be in 0\.\.8"):
        Accelerator(name="x", label="X", memory_bytes=GiB, bf16_flops=1e12, fp16_flops=1e12, fp32_flops=1e12,
                    intra_node_bw=1e9, intra_node_link="x", default_gpus_per_node=9)  # fmt: skip
