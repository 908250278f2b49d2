"""Launch commands as argv lists + env dicts (joined with ``shlex`` only for display), and the NCCL environment.

``ShellVar`` tokens stand for values a scheduler supplies at run time (``$SKYPILOT_NODE_RANK``,
``$SLURM_NODEID``); :meth:`Command.shell` writes them as ``"${NAME}"`` and quotes everything else, so user text
can never inject commands. Pure and stdlib only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from ..plan.hardware import Hardware
from ..plan.plan import Plan
from .common import Layout, RenderError, RenderOptions, layout_of

__all__ = [
    "ShellVar",
    "Command",
    "torchrun_command",
    "deepspeed_command",
    "accelerate_command",
    "launch_command",
    "render_hostfile",
    "render_nccl_env",
    "check_pdsh_safe",
]


class ShellVar(str):
    """An argv element that is a shell variable expanded on the node (``ShellVar("SLURM_NODEID")``)."""

    __slots__ = ()

    def shell(self) -> str:
        """The token as a double-quoted expansion, e.g. ``"${SLURM_NODEID}"``."""
        return f'"${{{self}}}"'


def _quote(token: str) -> str:
    if isinstance(token, ShellVar):
        return token.shell()
    return shlex.quote(token)


def _join(tokens: list[str]) -> str:
    """Quote each token; ShellVars become double-quoted expansions."""
    return " ".join(_quote(t) for t in tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """A process to start: ``argv`` (a list, never a shell string) and the ``env`` it adds."""

    argv: list[str]
    """Program and arguments."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to add."""

    def shell(self, *, with_env: bool = True) -> str:
        """One shell line: ``A=1 B='x y' torchrun ...`` with everything quoted."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items()) if with_env else ""
        return (prefix + " " if prefix else "") + _join(self.argv)

    def __str__(self) -> str:
        return self.shell()


class _Concat(ShellVar):
    """``host:port`` where the host is a shell variable: rendered as ``"${HOST}":port``."""

    __slots__ = ()

    def shell(self) -> str:
        var, _, rest = self.partition("|")
        return f'"${{{var}}}"{shlex.quote(rest)}'


def _endpoint(addr: str, port: int) -> str:
    if isinstance(addr, ShellVar):
        return _Concat(f"{addr}|:{port}")
    return f"{addr}:{port}"


def torchrun_command(
    plan: Plan, opts: RenderOptions | None = None, *, node_rank: str | int = 0, master_addr: str | None = None,
    layout: Layout | None = None,
) -> Command:
    """``torchrun`` for the plan: ``--standalone`` on one node; c10d or static rendezvous across nodes."""
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    addr = master_addr if master_addr is not None else opts.master_addr
    argv = ["torchrun", "--nproc-per-node", str(lay.gpus_per_node)]
    if not lay.multi_node:
        argv.insert(1, "--standalone")
    elif opts.rdzv == "c10d":
        endpoint = _endpoint(addr, opts.master_port)
        argv += ["--nnodes", str(lay.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", opts.name]  # fmt: skip
    else:
        rank = node_rank if isinstance(node_rank, ShellVar) else str(node_rank)
        argv += ["--nnodes", str(lay.nodes), "--node-rank", rank, "--master-addr", addr,
                 "--master-port", str(opts.master_port)]  # fmt: skip
    if opts.max_restarts:
        argv += ["--max-restarts", str(opts.max_restarts)]
    argv += [opts.script, *opts.script_args]
    return Command(argv=argv, env=render_nccl_env(plan, opts, layout=lay))


# What DeepSpeed's pdsh runner passes through its remote shell unharmed (see check_pdsh_safe).
_PDSH_ARG_RE = re.compile(r"^[\w@%+=:,./ -]+$", re.ASCII)
_PDSH_ENV_UNSAFE = re.compile(r"[$`\\\"!\n]")


def check_pdsh_safe(cmd: Command, opts: RenderOptions) -> None:
    """Refuse words that DeepSpeed's multi-node (pdsh) launcher would hand to a remote shell as syntax.

    DeepSpeed re-joins the script, its arguments and the ``.deepspeed_env`` exports into one string that pdsh runs
    through ssh: an argument is wrapped in double quotes only when it contains a space (so ``$(...)`` still runs),
    and an env value only when it has special characters (same problem). Our quoting cannot survive that re-join,
    so such values are refused instead of rendered.
    """
    for word in (opts.script, *opts.script_args, opts.checkpoint_dir):
        if not _PDSH_ARG_RE.match(word):
            raise RenderError(
                f"the deepspeed launcher on several nodes passes {word!r} through a remote shell (pdsh) without "
                "quoting it; use letters, digits, spaces and @%+=:,./- only, or launcher='torchrun' (each node "
                "starts its own processes, every argument stays one argv element)"
            )
    for key, value in cmd.env.items():
        if _PDSH_ENV_UNSAFE.search(value):
            raise RenderError(
                f"the deepspeed launcher on several nodes exports {key} to the other nodes through a remote shell "
                f'inside double quotes; its value must not contain $, `, \\, ", ! or a newline '
                "(or use launcher='torchrun')"
            )


def deepspeed_command(
    plan: Plan, opts: RenderOptions | None = None, *, config_path: str = "ds_config.json",
    hostfile: str = "hostfile", master_addr: str | None = None, layout: Layout | None = None,
) -> Command:
    """The ``deepspeed`` launcher, run on the head node only: it reaches the others through the hostfile (pdsh/ssh)."""
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    addr = master_addr if master_addr is not None else opts.master_addr
    argv = ["deepspeed"]
    if lay.multi_node:
        argv += ["--hostfile", hostfile, "--num_nodes", str(lay.nodes), "--master_addr", addr]
    argv += ["--num_gpus", str(lay.gpus_per_node), "--master_port", str(opts.master_port), opts.script,
             *opts.script_args, "--deepspeed", "--deepspeed_config", config_path]  # fmt: skip
    cmd = Command(argv=argv, env=render_nccl_env(plan, opts, layout=lay))
    if lay.multi_node:
        check_pdsh_safe(cmd, opts)
    return cmd


def accelerate_command(
    plan: Plan, opts: RenderOptions | None = None, *, config_path: str = "accelerate_config.yaml",
    node_rank: str | int = 0, master_addr: str | None = None, layout: Layout | None = None,
) -> Command:
    """``accelerate launch --config_file ...`` with the machine rank and main process address of this node."""
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    addr = master_addr if master_addr is not None else opts.master_addr
    argv = ["accelerate", "launch", "--config_file", config_path]
    if lay.multi_node:
        rank = node_rank if isinstance(node_rank, ShellVar) else str(node_rank)
        argv += ["--machine_rank", rank, "--main_process_ip", addr, "--main_process_port", str(opts.master_port)]
        if opts.rdzv == "c10d":  # accelerate launch ignores rdzv_backend from its config file
            argv += ["--rdzv_backend", "c10d"]
    argv += [opts.script, *opts.script_args]
    return Command(argv=argv, env=render_nccl_env(plan, opts, layout=lay))


def launch_command(
    plan: Plan, opts: RenderOptions | None = None, *, node_rank: str | int = 0, master_addr: str | None = None,
    layout: Layout | None = None,
) -> Command:
    """The command of ``opts.launcher``."""
    opts = opts or RenderOptions()
    if opts.launcher == "deepspeed":
        return deepspeed_command(plan, opts, master_addr=master_addr, layout=layout)
    if opts.launcher == "accelerate":
        return accelerate_command(plan, opts, node_rank=node_rank, master_addr=master_addr, layout=layout)
    return torchrun_command(plan, opts, node_rank=node_rank, master_addr=master_addr, layout=layout)


def render_hostfile(hosts: list[str], slots: int) -> str:
    """DeepSpeed hostfile: one ``host slots=N`` line per node."""
    for h in hosts:
        if not h or any(c.isspace() for c in h):
            raise RenderError(f"host name {h!r} must be non-empty and without spaces")
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def render_nccl_env(plan: Plan, opts: RenderOptions | None = None, *, layout: Layout | None = None) -> dict[str, str]:
    """NCCL / PyTorch environment for the plan's network, plus the diagnostics we want on by default.

    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: a failed or timed-out collective aborts the process group instead of
      hanging (PyTorch >= 2.2 name of ``NCCL_ASYNC_ERROR_HANDLING``).
    * ``TORCH_NCCL_TRACE_BUFFER_SIZE``: keep the flight recorder's last collectives, ``TORCH_NCCL_DUMP_ON_TIMEOUT``:
      dump them when a collective times out (the communication-health tooling reads them).
    * InfiniBand / RoCE: GPUDirect RDMA on; RoCE v2 needs GID index 3. AWS EFA: the libfabric ``efa`` provider with
      device RDMA. Plain TCP: no IB, exclude loopback and docker interfaces, more sockets per peer.
    """
    opts = opts or RenderOptions()
    lay = layout or layout_of(plan, opts)
    hw: Hardware = plan.hardware
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "NCCL_DEBUG": opts.nccl_debug.upper(),
    }
    if lay.multi_node:
        name = hw.interconnect.name
        if name.startswith("infiniband"):
            env.update(NCCL_IB_DISABLE="0", NCCL_NET_GDR_LEVEL="PHB")
        elif name.startswith("roce"):
            env.update(NCCL_IB_DISABLE="0", NCCL_IB_GID_INDEX="3", NCCL_NET_GDR_LEVEL="PHB")
        elif name.startswith("efa"):
            env.update(FI_PROVIDER="efa", FI_EFA_USE_DEVICE_RDMA="1", NCCL_IB_DISABLE="1")
        else:
            env.update(NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="^lo,docker", NCCL_SOCKET_NTHREADS="4",
                       NCCL_NSOCKS_PERTHREAD="4")  # fmt: skip
    env.update(dict(opts.env))
    return env
