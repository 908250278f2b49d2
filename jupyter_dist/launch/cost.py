"""What a SkyPilot launch costs, before it starts: the hourly price of the nodes from SkyPilot's own catalog.

SkyPilot keeps a price list per cloud (``vms.csv`` under its catalog folder, ``~/.sky/catalogs/<version>/<cloud>``;
``sky show-gpus`` downloads it). :func:`price_nodes` reads the cached lists (never the network, never a cloud API):
the cheapest instance with the requested accelerators, per node, on demand or spot, on the requested cloud or on any
cloud whose list is here. The estimate of a run is that price x nodes x the plan's step time x the steps given
(``--steps``). Where no list knows the accelerator, the answer says so and why, rather than guessing.
:func:`price_for` prices one of the planner's accelerators, and :func:`price_line` is the one line the dry run and
the wizard's Launch tab show.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CPU_NOT_PRICED", "Price", "catalog_dir", "price_for", "price_line", "price_nodes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Price:
    """The hourly price of the requested nodes, or why it is unknown."""

    per_node_hour: float | None
    """US dollars per node-hour (``None``: unknown, see ``reason``)."""
    nodes: int
    """Nodes priced."""
    instance: str = ""
    """The instance type priced (the cheapest with the accelerators)."""
    cloud: str = ""
    """Its cloud."""
    region: str = ""
    """Its region."""
    spot: bool = False
    """Spot price."""
    reason: str = ""
    """Why the price is unknown."""

    @property
    def per_hour(self) -> float | None:
        """All nodes, per hour."""
        return None if self.per_node_hour is None else self.per_node_hour * self.nodes

    def estimate(self, step_time_s: float | None, steps: int | None) -> float | None:
        """Dollars for ``steps`` steps of ``step_time_s`` seconds (``None`` when any is unknown)."""
        if self.per_hour is None or step_time_s is None or not steps:
            return None
        return self.per_hour * step_time_s * steps / 3600.0

    def describe(self, step_time_s: float | None = None, steps: int | None = None) -> str:
        """One line for the dry run."""
        if self.per_node_hour is None:
            return f"price unknown: {self.reason}"
        kind = "spot" if self.spot else "on demand"
        text = (f"price: ${self.per_hour:,.2f}/hour for {self.nodes} x {self.instance} ({self.cloud} {self.region}, "
                f"{kind}, ${self.per_node_hour:,.2f}/node-hour; SkyPilot's catalog)")  # fmt: skip
        est = self.estimate(step_time_s, steps)
        if est is not None:
            text += f"; estimated ${est:,.2f} for {steps} steps x {step_time_s:.3g} s (the plan's step time)"
        elif step_time_s is not None:
            text += f"; {step_time_s:.3g} s per planned step (give --steps N for the run's estimate)"
        return text


def catalog_dir() -> Path | None:
    """SkyPilot's versioned catalog folder on this machine, or ``None`` without SkyPilot."""
    try:
        from sky.catalog import common
    except ImportError:
        return None
    return Path(common.get_catalog_path("x")).parent


def price_nodes(accelerator: str, count: int, nodes: int, *, infra: str | None = None, spot: bool = False,
                root: Path | None = None) -> Price:  # fmt: skip
    """The cheapest node with ``count`` x ``accelerator`` in the cached catalogs (``infra``: ``cloud[/region]``)."""
    root = root if root is not None else catalog_dir()
    if root is None:
        return Price(
            per_node_hour=None, nodes=nodes, reason='SkyPilot is not installed (pip install "jupyter-dist[sky]")'
        )
    cloud, _, region = (infra or "").partition("/")
    region = region.split("/", 1)[0]
    clouds = [cloud.lower()] if cloud else sorted(p.name for p in root.iterdir() if (p / "vms.csv").exists()) if (
        root.is_dir()) else []  # fmt: skip
    if cloud and cloud.lower() in ("slurm", "kubernetes", "k8s", "ssh"):
        return Price(per_node_hour=None, nodes=nodes, reason=f"{cloud} has no price list (your own cluster)")
    column = "SpotPrice" if spot else "Price"
    best: tuple[float, str, str, str] | None = None
    searched = []
    for name in clouds:
        path = root / name / "vms.csv"
        if not path.exists():
            continue
        searched.append(name)
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                if (row.get("AcceleratorName") or "").lower() != accelerator.lower():
                    continue
                try:
                    if abs(float(row.get("AcceleratorCount") or 0) - count) > 0.01:
                        continue
                    price = float(row.get(column) or "nan")
                except ValueError:
                    continue
                if price != price or (region and row.get("Region") != region):
                    continue
                if best is None or price < best[0]:
                    best = (price, row.get("InstanceType", ""), name, row.get("Region", ""))
    if best is None:
        where = f"{cloud}" + (f"/{region}" if region else "") if cloud else "any cloud"
        if not searched:
            reason = (f"SkyPilot's price list for {where} is not on this machine (`sky show-gpus {accelerator}:{count}"
                      + (f" --infra {cloud}" if cloud else "") + "` downloads it)")  # fmt: skip
        else:
            reason = f"no {accelerator}:{count} instance in SkyPilot's price list for {where}"
        return Price(per_node_hour=None, nodes=nodes, spot=spot, reason=reason)
    return Price(per_node_hour=best[0], nodes=nodes, instance=best[1], cloud=best[2], region=best[3], spot=spot)


CPU_NOT_PRICED = "CPU processes, no accelerator requested"
"""The reason a run of CPU processes has no price."""


def price_for(accelerator: Any, gpus_per_node: int, nodes: int, *, infra: str | None = None, spot: bool = False,
              root: Path | None = None) -> Price:  # fmt: skip
    """:func:`price_nodes` for one of our accelerators (an :class:`~jupyter_dist.plan.Accelerator`).

    Its SkyPilot name is looked up; CPU processes and accelerators SkyPilot has no name for are unknown, with the
    reason.
    """
    if accelerator.vendor == "cpu":
        return Price(per_node_hour=None, nodes=nodes, spot=spot, reason=CPU_NOT_PRICED)
    from ..render.skypilot import SKYPILOT_ACCELERATORS

    name = SKYPILOT_ACCELERATORS.get(accelerator.name)
    if name is None:
        return Price(per_node_hour=None, nodes=nodes, spot=spot,
                     reason=f"{accelerator.name} has no SkyPilot accelerator name (add one to "
                            "jupyter_dist.render.skypilot.SKYPILOT_ACCELERATORS)")  # fmt: skip
    return price_nodes(name, gpus_per_node, nodes, infra=infra, spot=spot, root=root)


def price_line(price: Price, *, step_time_s: float | None = None, steps: int | None = None) -> str:
    """The one line the SkyPilot dry run and the wizard's Launch tab show (one function: they cannot disagree)."""
    if price.reason == CPU_NOT_PRICED:
        return f"price: {CPU_NOT_PRICED} (not priced)"
    return price.describe(step_time_s, steps)
