"""One plan compiled into every artifact: a :class:`Bundle` that displays itself and writes itself to a folder.

Pure (no file I/O happens until :meth:`Bundle.write_to` is called, which is the caller's explicit request).
"""

from __future__ import annotations

import base64
import html
import json
import os
import shlex
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from ..plan.plan import Candidate, Plan
from ..plan.strategies import get_strategy
from .commands import Command, ShellVar, launch_command, render_nccl_env
from .common import Layout, RenderError, RenderOptions, layout_of, shell_env_line

__all__ = ["Bundle", "FILE_DESCRIPTIONS", "render_bundle"]

FILE_DESCRIPTIONS = {
    "plan.json": "the plan (memory in bytes), reloadable with Plan.from_dict",
    "train.py": "training script for the chosen strategy (replace build_model / build_dataset)",
    "ds_config.json": "DeepSpeed config",
    "accelerate_config.yaml": "accelerate launch --config_file",
    "launch.sh": "single command for this machine / the head node",
    "skypilot.yaml": "sky launch -c NAME skypilot.yaml",
    "job.sbatch": "sbatch job.sbatch",
    "nccl.env": "NCCL / PyTorch environment (source it)",
}
"""One line per file of a bundle: what it is for (the bundle's listing and the wizard's file panes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bundle:
    """Every artifact of one plan candidate, consistent with each other."""

    plan: Plan
    """The plan compiled."""
    options: RenderOptions
    """The options used."""
    layout: Layout
    """The resolved numbers every file was rendered from."""
    files: dict[str, str] = field(default_factory=dict)
    """File name -> content."""
    commands: dict[str, Command] = field(default_factory=dict)
    """Named commands (``launch``): argv + env."""
    notes: tuple[str, ...] = ()
    """Why an artifact is missing, and other remarks."""

    @property
    def candidate(self) -> Candidate:
        """The compiled candidate."""
        return self.layout.candidate

    def write_to(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write every file into ``directory`` (created if needed); scripts become executable. Returns the paths.

        Each file atomically (:func:`~jupyter_dist._atomic.write_atomic`): a failed write (a full disk) raises
        ``OSError`` naming the file and leaves no partial file behind, so a later ``--plan DIR`` never reads half a
        ``plan.json``. This is the render layer's one I/O, at the caller's explicit request.
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in self.files.items():
            path = root / name
            write_atomic(path, text, mode=0o755 if name.endswith((".sh", ".sbatch")) else None)
            paths.append(path)
        return paths

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: files, commands (argv + env) and notes."""
        return {
            "candidate": self.candidate.name,
            "files": dict(self.files),
            "commands": {
                k: {"argv": list(c.argv), "env": dict(c.env), "shell": c.shell()} for k, c in self.commands.items()
            },
            "notes": list(self.notes),
        }

    def to_text(self) -> str:
        """Plain summary: the candidate, the files and the launch command."""
        lines = [f"Bundle for {self.candidate.label} ({self.candidate.name}), {self.layout.nodes} node(s) x "
                 f"{self.layout.gpus_per_node} GPU(s), global batch {self.layout.global_batch}:"]  # fmt: skip
        for name, text in self.files.items():
            lines.append(f"  {name:24} {len(text.splitlines()):5d} lines  {FILE_DESCRIPTIONS.get(name, '')}")
        for key, cmd in self.commands.items():
            lines.append(f"{key}: {cmd.shell(with_env=False)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_html(self) -> str:
        """Tabs (one per file) with copy and download buttons; works without any extension installed."""
        uid = "jd" + uuid.uuid4().hex[:8]
        e = html.escape
        tabs, panes = [], []
        for i, (name, text) in enumerate(self.files.items()):
            tid = f"{uid}-{i}"
            checked = " checked" if i == 0 else ""
            tabs.append(
                f'<input type="radio" name="{uid}" id="{tid}"{checked} style="display:none">'
                f'<label for="{tid}" class="{uid}-tab">{e(name)}</label>'
            )
            data = base64.b64encode(text.encode()).decode()
            panes.append(
                f'<div class="{uid}-pane" data-for="{tid}">'
                f'<div style="margin:4px 0">'
                f'<button onclick="navigator.clipboard.writeText(atob(\'{data}\'))">Copy</button> '
                f'<a download="{e(name)}" href="data:text/plain;base64,{data}"><button>Download</button></a> '
                f"<small>{e(FILE_DESCRIPTIONS.get(name, ''))}</small></div>"
                f'<pre style="max-height:420px;overflow:auto">{e(text)}</pre></div>'
            )
        css_rules = "".join(
            f"#{uid}-{i}:checked ~ .{uid}-panes [data-for='{uid}-{i}']{{display:block}}"
            f"#{uid}-{i}:checked + label{{font-weight:bold;border-bottom:2px solid #1976d2}}"
            for i in range(len(self.files))
        )
        style = (f"<style>.{uid}-pane{{display:none}}.{uid}-tab{{padding:4px 10px;cursor:pointer;display:inline-block}}"
                 f"{css_rules}</style>")  # fmt: skip
        cmds = "".join(
            f"<p><b>{e(k)}</b>: <code>{e(c.shell(with_env=False))}</code></p>" for k, c in self.commands.items()
        )
        notes = "".join(f"<li>{e(n)}</li>" for n in self.notes)
        head = e(self.to_text().splitlines()[0])
        return (f'<div class="jupyter-dist-bundle">{style}<p>{head}</p>{cmds}'
                f'{"".join(tabs)}<div class="{uid}-panes">{"".join(panes)}</div>'
                + (f"<ul>{notes}</ul>" if notes else "") + "</div>")  # fmt: skip

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __repr__(self) -> str:
        return f"Bundle(candidate={self.candidate.name!r}, files={list(self.files)})"


def render_bundle(plan: Plan, opts: RenderOptions | None = None) -> Bundle:
    """Compile ``plan`` (its recommendation, or ``opts.candidate``) into every artifact."""
    from .accelerate import render_accelerate_yaml
    from .deepspeed import render_deepspeed_json
    from .skypilot import render_skypilot_yaml
    from .slurm import render_sbatch
    from .torch_code import render_train_script

    opts = opts or RenderOptions()
    layout = layout_of(plan, opts)
    needs_config_arg = opts.launcher != "deepspeed" and "--deepspeed_config" not in opts.script_args
    if layout.strategy.family == "deepspeed" and needs_config_arg:
        # the deepspeed launcher adds --deepspeed_config itself; torchrun / accelerate need it passed on
        opts = replace(opts, script_args=(*opts.script_args, "--deepspeed_config", "ds_config.json"))
    files: dict[str, str] = {"plan.json": json.dumps(plan.to_dict(), indent=2) + "\n"}
    notes: list[str] = []
    try:
        files["train.py"] = render_train_script(plan, opts, layout=layout)
    except RenderError as exc:
        notes.append(f"train.py not generated: {exc}")
    # zero1 with tp/pp/cp/ep runs as FSDP2 (runs_as): the layout's family is not the table's
    substituted = layout.strategy.family != get_strategy(layout.strategy.name).family
    if layout.strategy.family == "deepspeed":
        files["ds_config.json"] = render_deepspeed_json(plan, opts, layout=layout)
    elif opts.launcher == "deepspeed":
        raise RenderError(
            "the deepspeed launcher needs a DeepSpeed strategy (zero1/2/3...), but the candidate is "
            f"{layout.candidate.name}"
            + " (zero1 with model parallelism runs as FSDP2)" * substituted
            + "; use --launcher torchrun or pick a zero* candidate"
        )
    elif substituted:  # zero1 with tp/pp/cp/ep: what runs is FSDP2, so no DeepSpeed config
        notes.append(
            f"ds_config.json not written: {layout.candidate.name} runs as FSDP2 with reshard_after_forward=False over "
            "the data-parallel dims (optimizer states and gradients sharded, parameters gathered once per step and "
            "kept to the backward), as the workers run it: DeepSpeed's engine cannot take tensor-, pipeline-, "
            "context- or expert-parallel layouts, so train.py is an FSDP2 script"
        )
    if opts.launcher == "accelerate":
        files["accelerate_config.yaml"] = render_accelerate_yaml(plan, opts, layout=layout)  # errors surface
    else:
        try:
            files["accelerate_config.yaml"] = render_accelerate_yaml(plan, opts, layout=layout)
        except RenderError as exc:  # e.g. expert parallelism: accelerate has no such plugin; the rest still applies
            notes.append(f"accelerate_config.yaml not generated: {exc}")
    if layout.multi_node:
        launch = launch_command(plan, opts, node_rank=ShellVar("NODE_RANK"), master_addr=ShellVar("MASTER_ADDR"),
                                layout=layout)  # fmt: skip
    else:
        launch = launch_command(plan, opts, layout=layout)
    env = render_nccl_env(plan, opts, layout=layout)
    files["nccl.env"] = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    files["launch.sh"] = _launch_script(launch, layout)
    files["skypilot.yaml"] = render_skypilot_yaml(plan, opts, layout=layout)
    files["job.sbatch"] = render_sbatch(plan, opts, layout=layout)
    return Bundle(plan=plan, options=opts, layout=layout, files=files, commands={"launch": launch}, notes=tuple(notes))


def _launch_script(cmd: Command, layout: Layout) -> str:
    lines = [
        "#!/usr/bin/env bash",
        "# Generated by jupyter-dist: launch on this machine (single node) or on each node.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
    ]
    if layout.multi_node:
        lines += [
            f"# {layout.nodes} nodes: run this on every node with MASTER_ADDR = the first node's address and",
            "# NODE_RANK = 0..N-1 (only NODE_RANK=0 for the deepspeed launcher);",
            "# a scheduler does this for you: job.sbatch (SLURM) or skypilot.yaml.",
            ': "${MASTER_ADDR:?set MASTER_ADDR to the first node\'s address}"',
            ': "${NODE_RANK:?set NODE_RANK to this node\'s index, 0 on the first}"',
        ]
    lines.append(shell_env_line(cmd.env))
    lines.append(cmd.shell(with_env=False))
    return "\n".join(lines) + "\n"
