"""Diagnose communication failures from rank logs (stdlib only): classify, find the first failing rank, say the fix.

A failed distributed job leaves one log per rank, and most of those logs are noise: when one rank dies, every
other rank reports *that* ("Connection closed by peer", "ncclRemoteError", a watchdog timeout ten minutes later).
This module reads the real message formats of PyTorch (c10d, ProcessGroupNCCL, ProcessGroupGloo, TCPStore,
torchrun) and of NCCL itself, and answers three questions:

* what went wrong on each rank -- :func:`classify` turns a log into :class:`Finding` objects, each with a stable
  ``kind``, the evidence lines, a concrete ``fix`` and whether it is a root cause or a consequence (``primary``);
* which rank failed first -- :func:`diagnose_ranks` picks it (earliest exit, else the rank with a root cause, else
  the rank a timeout report names) and orders the findings so that the cause comes before the cascade;
* what NCCL set up -- :func:`parse_nccl_line` reads NCCL's debug line format and :func:`nccl_facts` summarises
  the init lines (version, network, transports, ranks, nodes, warnings) as :class:`NcclFacts`.

Every pattern below carries a comment naming the source that emits the message and its format string; the
golden tests in ``tests/test_diagnose.py`` reproduce complete logs in those formats.

Planned split: the patterns as a table (``_KIND_INFO`` and ``_RULES``, each with its source; about 600 lines) apart
from the engine that applies them (:func:`classify`, :func:`diagnose_ranks`) and from the NCCL debug-line parser
(:func:`parse_nccl_line`, :func:`nccl_facts`) (issue 17; docs/architecture.md, "Planned").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "KINDS",
    "NcclLine",
    "NcclFacts",
    "Finding",
    "Diagnosis",
    "parse_nccl_line",
    "nccl_facts",
    "classify",
    "diagnose_ranks",
    "split_by_rank",
    "parse_child_failures",
]

# Roles: "cause" (a root cause on this rank), "hang" (a timeout: primary unless another rank shows a cause),
# "consequence" (this rank reports that someone else failed).
_ROLE_ORDER = {"cause": 0, "hang": 1, "consequence": 2}
_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
_EVIDENCE_MAX = 3
_LINE_MAX = 400

# --------------------------------------------------------------------------------------------------------------
# NCCL's debug line format
# --------------------------------------------------------------------------------------------------------------

# NCCL src/debug.cc, ncclDebugLogV: an optional "[%F %T] " timestamp (NCCL_DEBUG_TIMESTAMP_LEVELS, WARN by
# default since 2.26), then "%s:%d:%d " (hostname, pid, tid), then per level:
#   INFO  "[%d] NCCL INFO %s"                       (cuda device, message)
#   WARN  "[%d] %s:%d NCCL WARN %s"                 (device, source file, line; older: "\n" prefix, same fields)
#         "[%d] %s:%d (%s) NCCL WARN %s"            (newest: the function name in parentheses)
#   TRACE "[%d] %f %s:%d NCCL TRACE %s"             (device, ms since init, function, line)
#   CALL  "NCCL CALL %s"                            (no device)
# torchrun may prefix "[default0]:" (--tee, role + local rank) and the rank's own excepthook "[rank0]:".
_NCCL_LINE = re.compile(
    r"(?:^|[\s\]:])(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d+):(?P<tid>\d+) (?:\[(?P<dev>-?\d+)\] "
    r"(?P<src>(?:[\d.]+ )?\S+?:\d+(?: \([^)]*\))? )?NCCL (?P<level>INFO|WARN|TRACE|ABORT)|NCCL (?P<call>CALL))"
    r"\b ?(?P<msg>.*)$"
)
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
# "[default0]:" (torchrun --tee/--role, local rank), "[rank0]:" (excepthook installed by init_process_group),
# "(RayWorkerWrapper pid=123, ip=10.0.0.1)" (Ray), one each at most, in that order.
_LINE_PREFIXES = re.compile(r"^(?:\[[A-Za-z_][\w\-]*?\d+\]: ?)?(?:\[rank\d+\]: ?)?(?:\([\w]+ pid=\d+[^)]*\) ?)?")


@dataclass(frozen=True)
class NcclLine:
    """One NCCL debug line: ``<host>:<pid>:<tid> [<cuda dev>] NCCL <LEVEL> <message>``."""

    host: str
    pid: int
    tid: int
    device: int | None
    level: str
    message: str
    source: str | None = None
    """``file.cc:line`` (WARN) or ``function:line`` (TRACE); None for INFO."""
    rank: int | None = None
    """From a ``[rank<k>]:`` prefix, when torch added one."""


def parse_nccl_line(line: str) -> NcclLine | None:
    """Parse one NCCL debug line (any prefix before the hostname is skipped); None if the line is not one."""
    m = _NCCL_LINE.search(line.rstrip("\r\n"))
    if m is None:
        return None
    src = (m["src"] or "").strip()
    rank_m = _RANK_PREFIX.search(line[: m.start("host") + 1])
    return NcclLine(
        host=m["host"],
        pid=int(m["pid"]),
        tid=int(m["tid"]),
        device=int(m["dev"]) if m["dev"] is not None else None,
        level=m["level"] or m["call"],
        message=m["msg"].strip(),
        source=src or None,
        rank=int(rank_m.group(1)) if rank_m else None,
    )


@dataclass
class NcclFacts:
    """What NCCL's init lines say about a communicator (empty when NCCL_DEBUG was not INFO)."""

    version: str | None = None
    transports: set[str] = field(default_factory=set)
    """Subset of {"P2P", "SHM", "NET/IB", "NET/Socket", "NET/<plugin>", "NVLS", "COLLNET"} seen in channel lines."""
    network: str | None = None
    """The network plugin in use: "IB", "Socket", "AWS Libfabric", ..."""
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    interfaces: list[str] = field(default_factory=list)
    """NICs NCCL opened, as NCCL prints them ("mlx5_0:1/IB", "eth0:10.0.0.1<0>")."""
    bootstrap: str | None = None
    """The bootstrap (out-of-band) interface, e.g. "eth0:10.0.0.1<0>"."""
    gdr: bool = False
    """GPUDirect RDMA seen on a channel ("/GDRDMA")."""
    init_complete: bool = False
    warnings: list[str] = field(default_factory=list)
    """The messages of NCCL WARN lines, de-duplicated, in order."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return {
            "version": self.version, "transports": sorted(self.transports), "network": self.network,
            "nranks": self.nranks, "nnodes": self.nnodes, "local_ranks": self.local_ranks,
            "interfaces": list(self.interfaces), "bootstrap": self.bootstrap, "gdr": self.gdr,
            "init_complete": self.init_complete, "warnings": list(self.warnings),
        }  # fmt: skip


# init.cc: INFO(NCCL_ALL, "NCCL version %s", ...) (or VERSION-level "NCCL version %s" with no host prefix);
# torch's ncclGetErrorWithVersion appends ", NCCL version 2.21.5" to DistBackendError messages.
_VERSION = re.compile(r"\bNCCL version (\d+\.\d+\.\d+(?:[.+][\w.+\-]*)?)")
# transport/net.cc (NCCL 2.12+): "Using network %s" (IB, Socket, or a plugin's name such as "AWS Libfabric").
_USING_NETWORK = re.compile(r"^Using network (.+?)\s*$")
# transport/net_ib.cc: "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>";
# transport/net_socket.cc: "NET/Socket : Using [0]eth0:10.0.0.1<0> [1]eth1:...".
_NET_USING = re.compile(r"^NET/(IB|Socket) ?: ?Using (.*)$")
_NIC = re.compile(r"\[\d+\]([^\s\[;]+)")
# bootstrap.cc: "Bootstrap : Using eth0:10.0.0.1<0>" (older NCCL: "Bootstrap : Using [0]eth0:10.0.0.1<0>").
_BOOTSTRAP = re.compile(r"^Bootstrap ?: ?Using (?:\[\d+\])?(\S+)")
# init.cc: "comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d" (2.19+; older lacks MNNVL).
_COMM_TOPO = re.compile(r"\bnRanks (\d+) nNodes (\d+) localRanks (\d+)")
# init.cc: "%s comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init START|COMPLETE"
_COMM_INIT = re.compile(r"\bnranks (\d+) cudaDev .* - Init (START|COMPLETE)")
# transport.cc / p2p.cc / shm.cc / net.cc:
#   "Channel %02d/%d : %d[%d] -> %d[%d] via P2P/CUMEM/read" | "via P2P/IPC" | "via P2P/direct pointer"
#   "Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct"
#   "Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0(1)/GDRDMA" | "[receive] via NET/Socket/0"
#   older (< 2.12): "Channel 00 : 0[18000] -> 1[3b000] via P2P/IPC"
_VIA = re.compile(r"\bvia (P2P|SHM|NVLS|COLLNET|CollNet|NET/[A-Za-z][\w ]*?)(?=/|\s|$)(\S*)")


def nccl_facts(text: str | Iterable[str]) -> NcclFacts:
    """Summarise NCCL's init lines (NCCL_DEBUG=INFO) found in ``text`` (a log, or its lines)."""
    facts = NcclFacts()
    lines = text.splitlines() if isinstance(text, str) else text
    for raw in lines:
        line = parse_nccl_line(raw) if "NCCL" in raw else None
        if line is None:
            if facts.version is None and (m := _VERSION.search(raw)):
                facts.version = m.group(1)
            continue
        msg = line.message
        if line.level == "WARN":
            if msg and msg not in facts.warnings:
                facts.warnings.append(msg)
            continue
        if (m := _VERSION.search(msg)) and facts.version is None:
            facts.version = m.group(1)
        elif m := _USING_NETWORK.match(msg):
            facts.network = m.group(1)
        elif m := _NET_USING.match(msg):
            for nic in _NIC.findall(m.group(2)):
                if nic not in facts.interfaces:
                    facts.interfaces.append(nic)
            if facts.network is None:
                facts.network = m.group(1)
        elif m := _BOOTSTRAP.match(msg):
            facts.bootstrap = m.group(1)
        elif m := _COMM_TOPO.search(msg):
            facts.nranks, facts.nnodes, facts.local_ranks = int(m.group(1)), int(m.group(2)), int(m.group(3))
        elif m := _COMM_INIT.search(msg):
            facts.nranks = facts.nranks or int(m.group(1))
            facts.init_complete = facts.init_complete or m.group(2) == "COMPLETE"
        elif m := _VIA.search(msg):
            name = m.group(1).strip()
            facts.transports.add("COLLNET" if name.upper() == "COLLNET" else name)
            if "GDRDMA" in m.group(2):
                facts.gdr = True
    return facts


# --------------------------------------------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One classified problem in a rank's log."""

    kind: str
    """A stable id, one of :data:`KINDS`."""
    title: str
    """One line, specific to this occurrence (the operation, the peer, the size... when the message has them)."""
    evidence: tuple[str, ...]
    """The matching log line(s), prefixes kept, at most three."""
    fix: str
    """What to do: environment variables, flags, what to check."""
    severity: str = "error"
    """``error`` (a failure), ``warning`` (a likely problem that did not fail by itself) or ``info``."""
    primary: bool = True
    """True for a root cause on this rank; False for a consequence of another rank's failure."""
    role: str = "cause"
    """``cause``, ``hang`` (a timeout: primary only while no other rank shows a cause) or ``consequence``."""
    rank: int | None = None
    """The rank whose log this is (from a ``[rank<k>]:`` prefix, or set by :func:`diagnose_ranks`)."""
    line: int = 0
    """0-based index of the first evidence line in the log (-1 for a finding from an exit code)."""
    suspects: tuple[int, ...] = ()
    """Ranks the message itself names as the culprits (a monitored barrier, a desync report...)."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Values parsed from the message (operation, timeout, peer, status, size...)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return {
            "kind": self.kind, "title": self.title, "evidence": list(self.evidence), "fix": self.fix,
            "severity": self.severity, "primary": self.primary, "role": self.role, "rank": self.rank,
            "line": self.line, "suspects": list(self.suspects), "data": dict(self.data),
        }  # fmt: skip


@dataclass(frozen=True)
class _Kind:
    role: str
    label: str
    """Short plural-friendly label for summaries ("peer closed")."""
    fix: str
    severity: str = "error"


_DEBUG_NCCL = (
    " If the log has no 'NCCL WARN' line, rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET for less output): "
    "the first WARN line says why."
)

_KIND_INFO: dict[str, _Kind] = {
    "rank_exception": _Kind(
        "cause",
        "Python exception",
        "Fix the exception this rank raised (its traceback is in the evidence). The other ranks' errors follow from "
        "this rank exiting; decorate the entry point with torch.distributed.elastic.multiprocessing.errors.record "
        "so torchrun reports the traceback too.",
    ),
    "cuda_oom": _Kind(
        "cause",
        "CUDA out of memory",
        "Lower the per-GPU memory: a smaller micro-batch, activation checkpointing, more sharding (FSDP FULL_SHARD / "
        "ZeRO-3), bf16; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation. If NCCL ran out "
        "('Cuda failure ... out of memory'), leave headroom for its buffers (e.g. NCCL_BUFFSIZE=2097152, fewer "
        "process groups).",
    ),
    "host_oom": _Kind(
        "cause",
        "killed (host OOM)",
        "The kernel's OOM killer (or the container's memory limit) killed the process: check `dmesg -T | grep -i "
        "oom` / the pod's OOMKilled status; use fewer DataLoader workers, less pinned memory, load checkpoints with "
        "mmap=True / on rank 0 only, or raise the memory limit.",
    ),
    "cuda_error": _Kind(
        "cause",
        "CUDA error",
        "Rerun with CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA=1) to see the failing kernel. 'device-side "
        "assert' is usually an index out of range (labels vs. num_classes, embedding size); 'illegal memory "
        "access' a bad kernel or tensor; ECC / 'uncorrectable' / Xid errors are hardware: check `nvidia-smi -q -d "
        "ECC` and `dmesg | grep -i xid`, and drain the node.",
    ),
    "shm_too_small": _Kind(
        "cause",
        "/dev/shm too small",
        "/dev/shm is too small for NCCL's shared-memory transport or the DataLoader workers (Docker's default is "
        "64 MB). Run the container with --ipc=host or --shm-size=16g (Kubernetes: an emptyDir with medium: Memory "
        "mounted at /dev/shm; SLURM/enroot: a larger /dev/shm); remove stale /dev/shm/nccl-* files; as a last "
        "resort NCCL_SHM_DISABLE=1 (slower).",
    ),
    "socket_ifname": _Kind(
        "cause",
        "network interface not found",
        "Point NCCL (and gloo) at the interface that connects the nodes: NCCL_SOCKET_IFNAME=eth0 (a prefix, "
        "'=exact' or '^docker,lo' to exclude) and GLOO_SOCKET_IFNAME=eth0; the name must exist on every node "
        "(`ip -br addr`). An unset variable lets NCCL pick an interface; a wrong one finds none.",
    ),
    "gloo_loopback": _Kind(
        "cause",
        "gloo bound to loopback",
        "gloo could not resolve this host's name to a routable address and fell back to 127.0.0.1, which breaks "
        "multi-node runs: set GLOO_SOCKET_IFNAME to the inter-node interface or fix the hostname in /etc/hosts.",
        severity="warning",
    ),
    "socket_connect": _Kind(
        "cause",
        "cannot connect to peer",
        "A TCP connection between ranks failed. Check that the interface in NCCL's 'Bootstrap : Using' line is "
        "routable between the nodes (not docker0, lo or a link-local address) and pin it with NCCL_SOCKET_IFNAME "
        "/ GLOO_SOCKET_IFNAME; allow all TCP ports between the nodes (firewall, security group); NCCL_SOCKET_FAMILY"
        "=AF_INET if IPv6 is picked but not routed. If the peer had already crashed, this is a consequence: look "
        "at that rank.",
    ),
    "ib_retry_exceeded": _Kind(
        "cause",
        "IB retry exceeded",
        "The InfiniBand/RoCE transport gave up retransmitting (IBV_WC_RETRY_EXC_ERR, status 12): the peer was "
        "unreachable on the fabric or dead. Check the links (`ibstat`, `ibv_devinfo`, switch counters) and the "
        "peer's health; on RoCE set the right GID (NCCL_IB_GID_INDEX=3 for RoCEv2) and traffic class; raise "
        "NCCL_IB_TIMEOUT (e.g. 22) and NCCL_IB_RETRY_CNT (e.g. 7) on a congested fabric; restrict to healthy HCAs "
        "with NCCL_IB_HCA; NCCL_IB_DISABLE=1 (sockets) confirms it is the IB path.",
    ),
    "ib_completion_error": _Kind(
        "cause",
        "IB completion error",
        "An InfiniBand work request failed. Status 4 (local protection) or 10 (remote access) usually means "
        "GPUDirect RDMA registration is broken: load nvidia-peermem (or use DMA-BUF), disable PCIe ACS / set "
        "iommu=pt, try NCCL_NET_GDR_LEVEL=LOC to rule GDR out; check `ibv_devinfo` and NCCL_IB_HCA.",
    ),
    "registration_failure": _Kind(
        "cause",
        "memory registration failed",
        "Registering memory with the NIC failed: lift the locked-memory limit (ulimit -l unlimited; docker --ulimit "
        "memlock=-1; '* soft/hard memlock unlimited' in /etc/security/limits.conf; SLURM PropagateResourceLimits), "
        "load nvidia-peermem for GPUDirect RDMA or try NCCL_NET_GDR_LEVEL=LOC / NCCL_DMABUF_ENABLE=0.",
    ),
    "nccl_version_mismatch": _Kind(
        "cause",
        "NCCL version mismatch",
        "Ranks loaded different NCCL libraries: install the same torch build (and nvidia-nccl-cu* wheel) on every "
        "node, compare `python -c 'import torch; print(torch.cuda.nccl.version())'`, and remove LD_LIBRARY_PATH / "
        "LD_PRELOAD entries that inject another libnccl.so. (NCCL prints versions as codes: 22105 = 2.21.5.)",
    ),
    "collective_mismatch": _Kind(
        "cause",
        "collective mismatch",
        "Ranks called different collectives (type, order, shapes or dtypes; the message says which differ). Run "
        "the same collectives in the same order on every rank: no collectives inside rank-dependent branches, the "
        "same number of steps per rank (DistributedSampler, drop_last), padded variable-size tensors.",
    ),
    "port_in_use": _Kind(
        "cause",
        "port in use",
        "Another process already listens on the rendezvous port (often a previous run that did not exit): choose "
        "a free port (torchrun --master-port / MASTER_PORT, or --standalone / --rdzv-endpoint host:0 to let it "
        "pick one) or stop the stale process (`ss -ltnp | grep <port>`).",
    ),
    "store_unreachable": _Kind(
        "cause",
        "store unreachable",
        "This rank could not reach the TCPStore at MASTER_ADDR:MASTER_PORT: check the address resolves and is "
        "reachable from every node (not 'localhost' on multi-node), the port is open in the firewall, and rank 0 / "
        "the torchrun agent that hosts the store actually started (look at its log first).",
    ),
    "nccl_error": _Kind(
        "cause",
        "NCCL error",
        "NCCL returned an error." + _DEBUG_NCCL + " Common causes: /dev/shm too small, wrong NCCL_SOCKET_IFNAME, "
        "IB/RoCE misconfiguration, a peer that crashed.",
    ),
    "monitored_barrier": _Kind(
        "hang",
        "monitored barrier timeout",
        "The named rank did not reach the barrier in time: read that rank's log and stack (`py-spy dump --pid`); "
        "it crashed, hangs, or takes a different code path.",
    ),
    "desync": _Kind(
        "hang",
        "desync report",
        "The desync report names the lagging ranks: read those ranks' logs and stacks; they crashed, hang, or "
        "skipped a collective.",
    ),
    "nccl_timeout": _Kind(
        "hang",
        "NCCL timeout",
        "A collective did not finish within the process-group timeout. The culprit is usually a rank that never "
        "reached it (it crashed, hangs elsewhere, or runs a different code path): look for a rank with another "
        "error or an earlier exit. Make every rank run the same collectives in the same order. "
        "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 with TORCH_NCCL_DUMP_ON_TIMEOUT=1 dumps what each rank was doing "
        "(flight recorder); TORCH_NCCL_DESYNC_DEBUG=1 names the lagging rank. Raise init_process_group(timeout=...)"
        " only when a step is legitimately long (rank 0 evaluating or checkpointing alone).",
    ),
    "gloo_timeout": _Kind(
        "hang",
        "gloo timeout",
        "A gloo collective waited longer than the process-group timeout for a peer: find the rank that never "
        "reached the collective (another error, an earlier exit, a hang: `py-spy dump --pid`). "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL checks that ranks call matching collectives; raise "
        "init_process_group(timeout=...) only if the wait is legitimate.",
    ),
    "watchdog_hang": _Kind(
        "hang",
        "watchdog stuck",
        "ProcessGroupNCCL's watchdog itself stopped making progress, which points at a stuck GPU or CUDA driver "
        "call: check `nvidia-smi`, `dmesg | grep -i xid`; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC sets how long it waits.",
    ),
    "rendezvous_timeout": _Kind(
        "hang",
        "rendezvous timeout",
        "Not every rank joined in time: check that all nodes started (scheduler, image pull, a crash before init), "
        "that --nnodes / --nproc-per-node / WORLD_SIZE match what was launched, and that every rank uses the same "
        "MASTER_ADDR:MASTER_PORT (or --rdzv-endpoint / --rdzv-id). Raise the timeout (--rdzv-conf join_timeout=, "
        "init_process_group(timeout=)) if startup is slow.",
    ),
    "peer_closed": _Kind(
        "consequence",
        "peer closed",
        "A consequence: a peer process exited or dropped the connection. Read the log of the rank that failed "
        "first. If no rank crashed, the network between the nodes failed (check links, NCCL_SOCKET_IFNAME, IB).",
    ),
    "comm_aborted": _Kind(
        "consequence",
        "communicator aborted",
        "A consequence: the communicator was torn down after an earlier error or timeout; the root cause is the "
        "first error on this or another rank.",
    ),
    "terminated": _Kind(
        "consequence",
        "terminated",
        "A consequence: the launcher (or the scheduler) stopped this process, normally after another rank failed. "
        "If every rank was terminated, check the job's time limit / preemption.",
    ),
    "silent_exit": _Kind(
        "cause",
        "exited without an error message",
        "The process died without a Python traceback: a native crash (SIGSEGV/SIGABRT: run with python -X "
        "faulthandler, check for mismatched CUDA/NCCL libraries), SIGBUS (usually /dev/shm too small: --ipc=host), "
        "or os._exit / sys.exit in user code.",
    ),
    "child_failed": _Kind(
        "consequence",
        "torchrun summary",
        "torchrun's summary of failed workers. Its 'Root Cause (first observed failure)' is simply the first exit "
        "the agent noticed, not necessarily the cause.",
        severity="info",
    ),
}

KINDS: tuple[str, ...] = tuple(_KIND_INFO)
"""Every finding kind, most specific first."""

_PRIORITY = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class _Hit:
    kind: str
    title: str
    data: Mapping[str, Any] = field(default_factory=dict)
    suspects: tuple[int, ...] = ()


_Describe = Callable[[re.Match[str]], _Hit]


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    describe: _Describe


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in re.findall(r"\d+", text)}))


def _field(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None


def _static(kind: str, title: str) -> _Describe:
    return lambda m: _Hit(kind, title)


def _nccl_timeout(m: re.Match[str]) -> _Hit:
    line = m.string
    op, seq = _field(r"OpType=(\w+)", line), _field(r"SeqNum=(\d+)", line)
    timeout, ran = _field(r"Timeout\(ms\)=(\d+)", line), _field(r"ran for (\d+) milliseconds", line)
    data: dict[str, Any] = {k: v for k, v in (("op", op), ("seq", seq), ("timeout_ms", timeout), ("ran_ms", ran)) if v}
    title = "NCCL collective timed out"
    if op:
        title += f": {op}" + (f" #{seq}" if seq else "")
    if ran or timeout:
        title += f" ran {ran or '?'} ms (timeout {timeout or '?'} ms)"
    return _Hit("nccl_timeout", title, data)


def _gloo_timeout(m: re.Match[str]) -> _Hit:
    return _Hit("gloo_timeout", f"gloo {m['op']} timed out after {m['ms']} ms waiting for a peer",
                {"op": m["op"], "timeout_ms": int(m["ms"])})  # fmt: skip


def _monitored(m: re.Match[str]) -> _Hit:
    ranks = _ranks(m["ranks"])
    who = ", ".join(map(str, ranks))
    return _Hit("monitored_barrier", f"rank {who} did not reach the monitored barrier within {m['ms']} ms",
                {"timeout_ms": int(m["ms"])}, suspects=ranks)  # fmt: skip


def _monitored_peer(m: re.Match[str]) -> _Hit:
    r = int(m["rank"])
    return _Hit("monitored_barrier", f"monitored barrier: errors waiting for rank {r} (check rank {r}'s log)",
                suspects=(r,))  # fmt: skip


def _desync_missing(m: re.Match[str]) -> _Hit:
    ranks = _ranks(m["ranks"])
    return _Hit("desync", f"desync report: ranks {list(ranks)} never joined the collective", suspects=ranks)


def _desync_lagging(m: re.Match[str]) -> _Hit:
    ranks = _ranks(m["ranks"])
    return _Hit("desync", f"desync report: ranks {list(ranks)} did not join collective #{m['seq']}",
                suspects=ranks)  # fmt: skip


def _mismatch(m: re.Match[str]) -> _Hit:
    line = m.string
    ops = re.findall(r"Rank (\d+) is running (?:inconsistent )?collective: CollectiveFingerPrint\([^)]*?OpType=(\w+)",
                     line)  # fmt: skip
    aspects = _field(r"Collectives differ in the following aspects:\s*(.+?)\s*$", line)
    title = "ranks called different collectives"
    if len(ops) >= 2:
        title += f": rank {ops[0][0]} {ops[0][1]} vs rank {ops[1][0]} {ops[1][1]}"
    if aspects:
        # ProcessGroupWrapper joins the two values with "vs" and no space before it: "Op type: ALLREDUCEvs BROADCAST"
        aspects = re.sub(r"(\S)vs ", r"\1 vs ", " ".join(aspects.split()))
        title += f" ({aspects})"
    return _Hit("collective_mismatch", title, {"aspects": aspects} if aspects else {})


def _ib_completion(m: re.Match[str]) -> _Hit:
    status = int(m["status"] or m["status2"])
    peer = m["peer"] or ""
    name = m["sname"] or {4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR", 10: "IBV_WC_REM_ACCESS_ERR",
                          12: "IBV_WC_RETRY_EXC_ERR", 13: "IBV_WC_RNR_RETRY_EXC_ERR"}.get(status, "")  # fmt: skip
    data = {"status": status, "peer": peer, "status_name": name}
    hca = _field(r"\bhca (\S+)", m.string)
    if hca:
        data["hca"] = hca
    frm = f" from {peer}" if peer else ""
    if status in (12, 13):
        return _Hit("ib_retry_exceeded", f"IB transport retry exceeded{frm} (status {status} {name})".rstrip(), data)
    if status == 5:
        # flushed work requests: the queue pair was already in error (a consequence of another failure)
        return _Hit("peer_closed", f"IB work requests flushed{frm} (queue pair in error after a failure)", data)
    return _Hit("ib_completion_error", f"IB completion error{frm} (status {status} {name})".rstrip(), data)


def _shm(m: re.Match[str]) -> _Hit:
    size = m.groupdict().get("size")
    data = {"size": int(size)} if size else {}
    what = f" of {int(size) / 2**20:.1f} MiB" if size else ""
    return _Hit("shm_too_small", f"cannot create a shared-memory segment{what} in /dev/shm", data)


def _oom(m: re.Match[str]) -> _Hit:
    line = m.string
    tried = _field(r"Tried to allocate ([\d.]+ [KMGT]i?B)", line)
    gpu = _field(r"GPU (\d+)", line)
    title = "CUDA out of memory" + (f" on GPU {gpu}" if gpu else "")
    title += f" (tried to allocate {tried})" if tried else ""
    if "Cuda failure" in line:
        title = "NCCL: CUDA out of memory while allocating its buffers"
    return _Hit("cuda_oom", title, {k: v for k, v in (("tried", tried), ("gpu", gpu)) if v})


def _cuda_error(m: re.Match[str]) -> _Hit:
    what = m.group("what") if m.group("what") is not None else m.group("what2")
    if what is None:
        return _Hit("cuda_error", "NCCL: unhandled CUDA error")
    what = what.strip().rstrip(".")
    if "out of memory" in what:
        return _Hit("cuda_oom", "CUDA out of memory")
    return _Hit("cuda_error", f"CUDA error: {what}", {"error": what})


def _version_mismatch(m: re.Match[str]) -> _Hit:
    def v(code: str) -> str:
        c = int(code)
        major, rest = (c // 10000, c % 10000) if c >= 20900 else (c // 1000, c % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"

    return _Hit("nccl_version_mismatch",
                f"NCCL version mismatch: rank {m['r1']} has {v(m['v1'])}, rank {m['r2']} has {v(m['v2'])}",
                {"versions": {int(m["r1"]): v(m["v1"]), int(m["r2"]): v(m["v2"])}})  # fmt: skip


def _peer(title: str) -> _Describe:
    def describe(m: re.Match[str]) -> _Hit:
        peer = m.groupdict().get("peer")
        return _Hit("peer_closed", title + (f" ({peer})" if peer else ""), {"peer": peer} if peer else {})

    return describe


def _nccl_error(m: re.Match[str]) -> _Hit:
    what = (m.groupdict().get("what") or m.group(0)).strip().rstrip(",")
    return _Hit("nccl_error", f"NCCL error: {what}", {"error": what})


def _port(m: re.Match[str]) -> _Hit:
    port = _field(r"port: (\d+)", m.string) or _field(r"\]:(\d+) ", m.string)
    return _Hit("port_in_use", "address already in use" + (f" (port {port})" if port else ""),
                {"port": int(port)} if port else {})  # fmt: skip


def _store_unreachable(m: re.Match[str]) -> _Hit:
    host, port = m["host"], m["port"]
    return _Hit("store_unreachable", f"cannot reach the TCPStore at {host}:{port}", {"host": host, "port": int(port)})


def _clients_joined(m: re.Match[str]) -> _Hit:
    return _Hit("rendezvous_timeout", f"only {m['n']}/{m['w']} ranks joined within {m['s']} s",
                {"joined": int(m["n"]), "world_size": int(m["w"])})  # fmt: skip


def _missing_ranks(m: re.Match[str]) -> _Hit:
    ranks = _ranks(m["ranks"]) if re.fullmatch(r"[\d,\s]*", m["ranks"]) else ()
    return _Hit("rendezvous_timeout", f"barrier timed out; missing ranks [{m['ranks']}]", suspects=ranks)


def _signal(m: re.Match[str]) -> _Hit:
    sig = m.groupdict().get("sig")
    return _Hit("terminated", "terminated by signal" + (f" {sig}" if sig else "") + " (stopped by the launcher)")


# Cheap prefilter: a line reaches the rules below only if it contains one of these (lower-case) words. Every rule's
# pattern contains at least one of them: keep the two in step when adding a rule.
_KEYWORDS = (
    "monitoredbarrier", "lagging", "didn't join", "mismatch", "timeout", "timed out", "heartbeat monitor",
    "watchdog", "socket", "eaddrinuse", "already in use", "completion", "ibv_", "shared memory", "/dev/shm",
    "posix_fallocate", "bus error", "interface", "unable to find address", "unable to resolve hostname",
    "connect", "out of memory", "outofmemory", "killed", "oom-kill", "cuda", "nccl", "remote process",
    "entire process", "signalexception", "keyboardinterrupt", "childfailederror", "system error", "internal error",
)  # fmt: skip
# NCCL's INFO/TRACE/CALL lines report progress, never a failure (its failures are WARN lines)
_NCCL_CHATTER = re.compile(r"\d+:\d+:\d+ (?:\[-?\d+\] (?:[\d.]+ \S+:\d+ )?)?NCCL (?:INFO|TRACE|CALL) ")

# Ordered: the first rule that matches a line wins, so specific messages come before generic ones.
_RULES: tuple[_Rule, ...] = tuple(
    _Rule(re.compile(p), d)
    for p, d in (
        # ---- hangs and the reports that name the culprit ---------------------------------------------------
        # ProcessGroupGloo.cpp monitoredBarrier: "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms"
        # (wait_all_ranks=True: "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms")
        (r"Ranks? (?P<ranks>\d+(?:, \d+)*) failed to pass monitoredBarrier in (?P<ms>\d+) ms", _monitored),
        # ProcessGroupGloo.cpp: "Rank 1 successfully reached monitoredBarrier, but received errors while waiting
        # for send/recv from rank 0. Please check rank 0 logs for faulty rank."
        (r"received errors while waiting for send/recv from rank (?P<rank>\d+)", _monitored_peer),
        # c10d TraceUtils.h analyzeMissingRanks: "To our best knowledge, ranks [1, 2] are the lagging ranks that
        # caused this timeout. They never joined any collectives"
        (r"ranks \[(?P<ranks>[\d, ]+)\] are the lagging ranks", _desync_missing),
        # TraceUtils.h analyzeLaggingRanks: "[3] finished collective #5, but didn't join collective #6"
        (r"\[(?P<ranks>[\d, ]+)\] finished collective #\d+, but didn't join collective #(?P<seq>\d+)", _desync_lagging),
        # ProcessGroupWrapper.cpp (TORCH_DISTRIBUTED_DEBUG=DETAIL): "Detected mismatch between collectives on
        # ranks. Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, ...),
        # but Rank 0 is running collective: CollectiveFingerPrint(...).Collectives differ in the following
        # aspects:   Op type: BROADCASTvs ALLREDUCE"
        (r"Detected mismatch between collectives on ranks", _mismatch),
        # ProcessGroupNCCL.cpp checkTimeout: "[Rank 1] Watchdog caught collective operation timeout:
        # WorkNCCL(SeqNum=6463, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800017
        # milliseconds before timing out." (TORCH_NCCL_BLOCKING_WAIT=1: "Caught collective operation timeout")
        (r"(?:Watchdog caught|Caught) collective operation timeout", _nccl_timeout),
        # NCCLUtils.cpp waitUntilInitialized: "NCCL timeout in communicator initialization."
        (r"NCCL timeout in communicator initialization", _static("nccl_timeout", "NCCL communicator init timed out")),
        # ProcessGroupNCCL.cpp heartbeat monitor: "Heartbeat monitor timed out! Process will be terminated after
        # dumping debug info." / "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress"
        (
            r"Heartbeat monitor timed out|watchdog got stuck for \d+ seconds",
            _static("watchdog_hang", "the NCCL watchdog stopped making progress"),
        ),
        # gloo transport/tcp/unbound_buffer.cc: "Timed out waiting 5000ms for recv operation to complete"
        (r"Timed out waiting (?P<ms>\d+)ms for (?P<op>\w+) operation to complete", _gloo_timeout),
        # ---- store / rendezvous -------------------------------------------------------------------------
        # TCPStore.cpp (server, waitForWorkers): "Timed out after 5 seconds waiting for clients. 1/2 clients
        # joined."
        (
            r"Timed out after (?P<s>\d+) seconds waiting for clients\. (?P<n>\d+)/(?P<w>\d+) clients joined",
            _clients_joined,
        ),
        # distributed_c10d.py _store_based_barrier: "Timed out initializing process group in store based barrier
        # on rank 3, for key: ... (world_size=8, num_workers_joined=7, timeout=0:30:00 error=...)"
        (
            r"Timed out initializing process group in store based barrier",
            _static("rendezvous_timeout", "timed out initializing the process group (store-based barrier)"),
        ),
        # elastic/utils/store.py barrier: "Timed out waiting on barrier on rank 0, for key prefix: ...
        # (world_size=2, missing_ranks=[1], timeout=...)"
        (r"Timed out waiting on barrier on rank \d+.*missing_ranks=\[(?P<ranks>[^\]]*)\]", _missing_ranks),
        # elastic rendezvous/api.py: class RendezvousTimeoutError (raised bare by dynamic_rendezvous.py)
        (r"RendezvousTimeoutError", _static("rendezvous_timeout", "torchrun rendezvous timed out")),
        # TCPStore.cpp doWait: "wait timeout after 1800000ms, keys: /default_pg//cuda//0"; legacy TCPStore:
        # "Socket Timeout"
        (
            r"wait timeout after (?P<ms>\d+)ms, keys: |\bSocket Timeout\b",
            _static("rendezvous_timeout", "timed out waiting for other ranks in the TCPStore"),
        ),
        # socket.cpp: "The client socket has timed out after 4000ms while trying to connect to (127.0.0.1,
        # 29534)." / "The client socket has failed to connect to any network address of (host, port)."
        (
            r"The client socket has (?:timed out after \S+ while trying to connect to|failed to connect to any network"
            r" address of) \((?P<host>[^,]+), (?P<port>\d+)\)",
            _store_unreachable,
        ),
        # TCPStore.cpp: "TCP client failed to connect/validate to host 10.0.0.1:29500 - timed out (try=..."
        (r"TCP client failed to connect/validate to host (?P<host>\S+?):(?P<port>\d+) - timed out", _store_unreachable),
        # socket.cpp: "The server socket has failed to listen on any local network address. port: 29517,
        # useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"; older torch: "The server
        # socket has failed to bind to [::]:29500 (errno: 98 - Address already in use)." NCCL's own "Call to bind
        # failed: Address already in use" is excluded: NCCL retries other ports, so it is chatter.
        (
            r"The server socket has failed to (?:listen|bind)|EADDRINUSE|(?<!bind failed: )[Aa]ddress already in use",
            _port,
        ),
        # ---- NCCL and network ---------------------------------------------------------------------------
        # NCCL init.cc: WARN("Mismatched NCCL version detected : rank %d version %d rank %d version %d")
        (
            r"Mismatched NCCL version detected : rank (?P<r1>\d+) version (?P<v1>\d+) rank (?P<r2>\d+) version"
            r" (?P<v2>\d+)",
            _version_mismatch,
        ),
        # NCCL net_ib.cc, three generations:
        #   "NET/IB : Got completion from peer 10.2.0.5<33092> with error 12, opcode 0, len 0, vendor err 129 (Recv)"
        #   "NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err %d (%s) localGid ..."
        #   "NET/IB: Got completion from peer %s with status=%s(%d) opcode=%s(%d) vendor_err=%u ... hca %s"
        #   (also "NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129" without the peer)
        (
            r"Got completion (?:from peer (?P<peer>\S+) )?with (?:status=(?:(?P<sname>[A-Z_]+)\()?(?P<status>\d+)|"
            r"error (?P<status2>\d+))",
            _ib_completion,
        ),
        (r"IBV_WC_RETRY_EXC_ERR", _static("ib_retry_exceeded", "IB transport retry exceeded (IBV_WC_RETRY_EXC_ERR)")),
        # NCCL misc/shmutils.cc: WARN("Error: failed to extend %s to %ld bytes, error: %s (%d)") and
        # WARN("Error while %s shared memory segment %s (size %ld), error: %s (%d)"); NCCL < 2.12 shm.cc:
        # "Call to posix_fallocate failed : No space left on device", "unable to allocate shared memory".
        (r"Error while (?:creating|attaching to) shared memory segment \S+ \(size (?P<size>\d+)\)", _shm),
        (r"failed to extend /dev/shm/\S+ to (?P<size>\d+) bytes", _shm),
        (r"Call to posix_fallocate failed|unable to allocate shared memory|/dev/shm\S*.*No space left on device", _shm),
        # torch/csrc/DataLoader.cpp: "ERROR: Unexpected bus error encountered in worker. This might be caused by
        # insufficient shared memory (shm)."; dataloader.py: "DataLoader worker (pid 123) is killed by signal: Bus
        # error."
        (
            r"insufficient shared memory \(shm\)|DataLoader worker \(pid(?:\(s\))? [^)]*\) is killed by signal: Bus",
            _shm,
        ),
        # NCCL misc/ibvwrap.cc: WARN("Call to ibv_reg_mr failed with error %s"), ibv_reg_dmabuf_mr, ibv_create_qp
        (
            r"Call to (?P<call>ibv_reg_mr\w*|ibv_reg_dmabuf_mr|ibv_create_qp) failed",
            lambda m: _Hit("registration_failure", f"{m['call']} failed (NIC memory registration / QP creation)"),
        ),
        # NCCL bootstrap.cc: WARN("Bootstrap : no socket interface found"); net_socket.cc: WARN("NET/Socket : no
        # interface found"); gloo transport/tcp/device.cc: "Unable to find address for: eth0"
        (
            r"no socket interface found|NET/Socket : no interface found",
            _static("socket_ifname", "NCCL found no usable network interface"),
        ),
        (
            r"Unable to find address for:? (?P<ifname>\S+)",
            lambda m: _Hit("socket_ifname", f"gloo: interface {m['ifname']} not found", {"ifname": m["ifname"]}),
        ),
        # ProcessGroupGloo.cpp: "Unable to resolve hostname to a (local) address. Using the loopback address as
        # fallback. Manually set the network interface to bind to with GLOO_SOCKET_IFNAME."
        (
            r"Unable to resolve hostname to a \(local\) address",
            _static("gloo_loopback", "gloo fell back to the loopback address"),
        ),
        # NCCL misc/socket.cc: WARN("socketStartConnect: Connect to %s failed : %s"); WARN("socketPollConnect:
        # connect returned %s, exceeded error retry count (%d)"); ProcessGroupGloo.cpp "Gloo connectFullMesh
        # failed with ..."; gloo pair.cc "connect [10.0.0.2]:1234: Connection refused"
        (
            r"(?:socketStartConnect|socketPollConnect|ncclSocketConnect)\S*:? (?:Connect to (?P<peer>\S+) failed|"
            r"connect returned)",
            lambda m: _Hit(
                "socket_connect", "NCCL could not connect to a peer" + (f" at {m['peer']}" if m["peer"] else "")
            ),
        ),  # fmt: skip
        (r"Gloo connectFullMesh failed", _static("socket_connect", "gloo could not connect the full mesh of ranks")),
        (
            r"connect \[(?P<peer>[^\]]+)\]:\d+: (?:Connection refused|No route to host|Connection timed out)",
            lambda m: _Hit("socket_connect", f"gloo could not connect to {m['peer']}"),
        ),
        # CUDA: torch "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...";
        # NCCL WARN("Cuda failure '%s'") / WARN("Cuda failure %d '%s'") with 'out of memory'
        (r"CUDA out of memory|OutOfMemoryError|Cuda failure (?:\d+ )?'out of memory'", _oom),
        # dataloader.py: "DataLoader worker (pid(s) 123) exited unexpectedly" / "is killed by signal: Killed.";
        # kernel: "Out of memory: Killed process 1234 (python)"
        (
            r"is killed by signal: Killed|Out of memory: Killed process|oom-kill",
            _static("host_oom", "killed by the host's OOM killer"),
        ),
        # c10/cuda/CUDAException: "CUDA error: an illegal memory access was encountered"; NCCL "Cuda failure
        # 'uncorrectable ECC error encountered'"; ncclUnhandledCudaError
        (r"CUDA error: (?P<what>[^\n]*)|Cuda failure (?:\d+ )?'(?P<what2>[^']*)'|ncclUnhandledCudaError", _cuda_error),
        # ---- consequences -------------------------------------------------------------------------------
        # gloo transport/tcp/pair.cc: "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:6368. This is
        # typically caused by a remote worker crashing. ..." (and "Read error [ip]:port: Connection reset by peer")
        (r"Connection closed by peer \[?(?P<peer>[^\]\s]+)\]?(?::\d+)?", _peer("connection closed by peer")),
        # NCCL misc/socket.cc: WARN("socketProgress: Connection closed by remote peer %s"); older "Net :
        # Connection closed by remote peer %s"
        (r"Connection closed by remote peer (?P<peer>\S+)", _peer("connection closed by remote peer")),
        (r"Connection reset by peer", _peer("connection reset by peer")),
        (r"Socket unexpectedly closed", _peer("socket unexpectedly closed")),
        # TCPStore socket.cpp: "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server
        # shutdown or crash?"
        (
            r"Connection was likely closed\. Did the remote server shutdown or crash",
            _peer("lost the TCPStore connection (rank 0 or the agent exited)"),
        ),
        # ncclGetErrorString(ncclRemoteError) "remote process exited or there was a network error";
        # torch getNcclErrorDetailStr: "ncclRemoteError: A call failed possibly due to a network error or a
        # remote process exiting prematurely."
        (
            r"remote process exited or there was a network error|ncclRemoteError",
            _peer("NCCL remote error (a peer exited or the network failed)"),
        ),
        # NCCLUtils.cpp: "NCCL communicator was aborted on rank 3. Original reason for failure was: ..."
        # ProcessGroupNCCL.cpp: "Process group watchdog thread terminated with exception: ...",
        # "Some NCCL operations have failed or timed out. ...", "To avoid data inconsistency, we are taking the
        # entire process down."
        (
            r"NCCL communicator was aborted on rank|Process group watchdog thread terminated with exception|"
            r"Some NCCL operations have failed or timed out|taking the entire process down",
            _static("comm_aborted", "NCCL communicator aborted"),
        ),
        # elastic/multiprocessing/api.py: "SignalException: Process 1234 got signal: 15"; KeyboardInterrupt
        (r"SignalException: Process \d+ got signal: (?P<sig>\d+)|^KeyboardInterrupt\b", _signal),
        # elastic/multiprocessing/errors: "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
        (r"ChildFailedError", _static("child_failed", "torchrun reported failed workers")),
        # ---- generic NCCL errors (kept only when nothing more specific explains them) ---------------------
        # NCCLUtils.hpp C10D_NCCL_CHECK: "NCCL error in: <file>:<line>, <ncclGetErrorString>, NCCL version X"
        # ncclGetErrorString: "unhandled system error (run with NCCL_DEBUG=INFO for details)", "internal error -
        # please report this issue to the NCCL developers", "invalid usage (run with NCCL_DEBUG=WARN for
        # details)", "invalid argument (...)"; getNcclErrorDetailStr: "ncclSystemError: ...",
        # "ncclInternalError: Internal check failed.", "ncclInvalidUsage: ..."
        (r"NCCL error in: \S+, (?P<what>[^,(]+)", _nccl_error),
        (
            r"(?P<what>ncclSystemError|ncclInternalError|ncclInvalidUsage|ncclInvalidArgument|unhandled system error|"
            r"internal error - please report this issue to the NCCL developers)",
            _nccl_error,
        ),
    )
)


_TRACEBACK = "Traceback (most recent call last):"
# Python's final traceback line: "RuntimeError: boom", "torch.distributed.DistBackendError: NCCL error in: ..."
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
# Lines that end an exception message's continuation: glog lines ("E1122 06:29:09.534000 15696 ..."), the
# next traceback, chained-exception separators.
_CONT_END = re.compile(r"^(?:[EWIF]\d{4} \d\d:|Traceback |During handling|The above exception|\[[EWIF]\d{4} )")


def _strip(line: str) -> str:
    """Drop launcher/excepthook prefixes, keeping the indentation that follows them."""
    return _LINE_PREFIXES.sub("", line, count=1).rstrip()


def _line_rank(line: str) -> int | None:
    m = _RANK_PREFIX.search(line)
    return int(m.group(1)) if m else None


class _Acc:
    def __init__(self, hit: _Hit, line_no: int, line: str, rank: int | None) -> None:
        self.hit, self.line, self.rank = hit, line_no, rank
        self.evidence: list[str] = [line]
        self.suspects: set[int] = set(hit.suspects)


def _clip(line: str) -> str:
    line = line.rstrip()
    return line if len(line) <= _LINE_MAX else line[: _LINE_MAX - 1] + "…"


def classify(text: str, *, rank: int | None = None) -> list[Finding]:
    """Classify the communication and rank failures in one log; most important first.

    ``rank`` labels the findings (else the ``[rank<k>]:`` prefix torch adds to a rank's lines is used, and a log
    with one such rank is all that rank's). One finding per (kind, rank); a generic NCCL error or a communicator
    abort is dropped when a more specific error on the same rank explains it, and a Python traceback becomes a
    ``rank_exception`` only when no pattern explains its final exception.
    """
    lines = text.splitlines()
    if rank is None:
        prefixed = {r for r in map(_line_rank, lines) if r is not None}
        if len(prefixed) == 1:  # one rank's log: its unprefixed lines (NCCL's, C++ aborts) are that rank's too
            rank = prefixed.pop()
    acc: dict[tuple[str, int | None], _Acc] = {}
    matched: set[int] = set()

    def add(hit: _Hit, i: int, line_rank: int | None) -> None:
        key = (hit.kind, line_rank)
        a = acc.get(key)
        if a is None:
            acc[key] = _Acc(hit, i, _clip(lines[i]), line_rank)
        else:
            a.suspects.update(hit.suspects)
            if len(a.evidence) < _EVIDENCE_MAX and _clip(lines[i]) not in a.evidence:
                a.evidence.append(_clip(lines[i]))

    for i, raw in enumerate(lines):
        body = _strip(raw)
        low = body.lower()
        if not any(k in low for k in _KEYWORDS) or _NCCL_CHATTER.search(body):
            continue
        for rule in _RULES:
            m = rule.regex.search(body)
            if m is None:
                continue
            add(rule.describe(m), i, rank if rank is not None else _line_rank(raw))
            matched.add(i)
            break

    # Python tracebacks whose final exception no pattern explained: a plain exception on this rank
    in_tb = False
    for i, raw in enumerate(lines):
        body = _strip(raw)
        if body.strip() == _TRACEBACK:
            in_tb = True
            continue
        if not in_tb or not body or body[0].isspace():
            continue
        in_tb = False
        m = _EXC_LINE.match(body)
        if m is None:
            continue
        explained = False
        for j in range(i, min(len(lines), i + 30)):
            nxt = _strip(lines[j])
            if j > i and (not nxt.strip() or _CONT_END.match(nxt)):
                break
            if j in matched:
                explained = True
                break
        if explained:
            continue
        exc_type = m["type"].rsplit(".", 1)[-1]
        msg = (m["msg"] or "").strip()
        hit = _Hit("rank_exception", f"{exc_type}: {msg}" if msg else exc_type, {"type": m["type"], "message": msg})
        line_rank = rank if rank is not None else _line_rank(raw)
        key = ("rank_exception", line_rank)
        acc.pop(key, None)  # the last traceback of a chain is what ended the process
        acc[key] = _Acc(hit, i, _clip(lines[i]), line_rank)
        frame = _last_frame(lines, i)
        if frame is not None:
            acc[key].evidence.insert(0, _clip(frame))

    findings = [_finding(a) for a in acc.values()]
    # a combined stream: an unprefixed line ("what(): ...") of a kind that prefixed lines show is one of theirs
    with_rank = {f.kind for f in findings if f.rank is not None}
    findings = [f for f in findings if f.rank is not None or f.kind not in with_rank]
    # a generic NCCL error / an abort / a launcher summary on a rank that has a more specific error is redundant
    redundant = {"nccl_error", "comm_aborted", "child_failed"}
    specific = {f.rank for f in findings if f.kind not in redundant and f.severity == "error"}
    findings = [f for f in findings if not (f.kind in redundant and f.rank in specific)]
    return sorted(findings, key=_sort_key)


def _last_frame(lines: list[str], exc_line: int) -> str | None:
    for j in range(exc_line - 1, max(-1, exc_line - 40), -1):
        body = _strip(lines[j])
        if body.lstrip().startswith('File "'):
            return lines[j]
        if body.strip() == _TRACEBACK:
            return None
    return None


def _finding(a: _Acc) -> Finding:
    info = _KIND_INFO[a.hit.kind]
    role = info.role
    return Finding(
        kind=a.hit.kind, title=a.hit.title, evidence=tuple(a.evidence), fix=info.fix, severity=info.severity,
        primary=role != "consequence", role=role, rank=a.rank, line=a.line, suspects=tuple(sorted(a.suspects)),
        data=dict(a.hit.data),
    )  # fmt: skip


def _sort_key(f: Finding) -> tuple[int, int, int, int, int]:
    return (
        0 if f.primary else 1, _SEVERITY_ORDER.get(f.severity, 3), _ROLE_ORDER.get(f.role, 3),
        _PRIORITY.get(f.kind, 99), f.line,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Across ranks
# --------------------------------------------------------------------------------------------------------------

# signal number -> (name, kind, title); exit codes of torchrun's workers are -<signal> when a signal killed them
_SIGNALS: dict[int, tuple[str, str, str]] = {
    1: ("SIGHUP", "terminated", "terminated by SIGHUP"),
    2: ("SIGINT", "terminated", "interrupted (SIGINT)"),
    15: ("SIGTERM", "terminated", "terminated by SIGTERM (stopped by the launcher)"),
    9: ("SIGKILL", "host_oom", "killed by SIGKILL (usually the host's OOM killer)"),
    11: ("SIGSEGV", "silent_exit", "crashed with a segmentation fault (SIGSEGV)"),
    6: ("SIGABRT", "silent_exit", "aborted (SIGABRT)"),
    7: ("SIGBUS", "shm_too_small", "bus error (SIGBUS), typically /dev/shm exhausted"),
}


def _exit_finding(rank: int, code: int) -> Finding:
    if code < 0 and -code in _SIGNALS:
        name, kind, title = _SIGNALS[-code]
    elif code < 0:
        name, kind, title = f"signal {-code}", "silent_exit", f"killed by signal {-code}"
    else:
        name, kind, title = "", "silent_exit", f"exited with code {code} without an error message"
    info = _KIND_INFO[kind]
    return Finding(
        kind=kind, title=title, evidence=(f"exit code {code}" + (f" ({name})" if name else ""),), fix=info.fix,
        severity="error", primary=info.role != "consequence", role=info.role, rank=rank, line=-1,
        data={"exit_code": code},
    )  # fmt: skip


@dataclass
class Diagnosis:
    """Findings of every rank, the first failing rank, and the root cause first."""

    first_rank: int | None
    """The rank that failed first (None when no rank shows an error)."""
    root: Finding | None
    """The finding that explains the failure (on ``first_rank``, or the report on another rank that names it)."""
    findings: list[Finding]
    """Every finding, root cause first, then the other primary findings, then the consequences."""
    by_rank: dict[int, list[Finding]]
    facts: dict[int, NcclFacts]
    basis: str
    """How ``first_rank`` was chosen: ``exit_time``, ``cause``, ``named`` (a timeout report names it),
    ``timeout``, ``lowest_rank`` or ``none``."""
    suspects: list[int] = field(default_factory=list)
    """Ranks that timeout / barrier / desync reports name as not having arrived."""
    silent_ranks: list[int] = field(default_factory=list)
    """Ranks whose logs show no error at all while others failed (hung, killed, or simply stopped)."""
    hang: dict[str, Any] | None = None
    """For a run stopped by ``--hang-timeout``: the hang report of ``diagnosis.json`` (``culprit``, ``stalled_s``,
    ``reason``, ``phases``, ``issued``, ``where`` and every rank's ``stacks``); ``None`` otherwise."""

    early_exit: dict[str, Any] | None = None
    """For a run stopped because a rank ended without its normal exit (``os._exit``): the report of
    ``diagnosis.json`` (``rank``, ``code``, ``waiting``, ``where``, ``reason``); ``None`` otherwise."""

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Diagnosis:
        """The diagnosis the run wrote to ``diagnosis.json``: a hang report or an early-exit report."""
        if report.get("kind") == "early_exit":
            rank = report.get("rank")
            return cls(first_rank=int(rank) if isinstance(rank, int) else None, root=None, findings=[], by_rank={},
                       facts={}, basis="early_exit", early_exit=dict(report))  # fmt: skip
        return cls.from_hang(report)

    @classmethod
    def from_hang(cls, report: Mapping[str, Any]) -> Diagnosis:
        """The diagnosis of a hung run from its hang report (``first_rank`` is the rank that fell behind)."""
        culprit = report.get("culprit")
        return cls(first_rank=int(culprit) if isinstance(culprit, int) else None, root=None, findings=[],
                   by_rank={}, facts={}, basis="hang", hang=dict(report))  # fmt: skip

    def consequences(self) -> list[Finding]:
        """The findings that are consequences of the root cause."""
        return [f for f in self.findings if not f.primary]

    def summary(self) -> str:
        """One paragraph: which rank failed first and why, the fix, and what the other errors are."""
        if self.early_exit is not None:
            return str(self.early_exit.get("reason") or f"rank {self.first_rank} ended early")
        if self.hang is not None:
            h = self.hang
            where = "; ".join(f"rank {r} was at {w}" for r, w in (h.get("where") or {}).items())
            who = f"rank {self.first_rank} fell behind" if self.first_rank is not None else "no rank stood out"
            head = f"Hung: no step for {h.get('stalled_s')} s ({who}); {h.get('reason')}"
            return head + (f". {where}" if where else "")
        if self.root is None or self.first_rank is None:
            n = len(self.by_rank)
            return f"No communication or rank errors found in {n} rank log{'s' if n != 1 else ''}."
        root = self.root
        if root.rank is not None and root.rank != self.first_rank:
            head = f"rank {self.first_rank} failed first: {root.title} (reported by rank {root.rank})."
        else:
            head = f"rank {self.first_rank} failed first: {root.title}."
        parts = [head[0].upper() + head[1:], f"Fix: {root.fix}"]
        others = [f for f in self.findings if f is not root and f.rank != self.first_rank]
        cons = [f for f in others if not f.primary and f.severity == "error"]
        if cons:
            counts: dict[str, set[int | None]] = {}
            for f in cons:
                counts.setdefault(_KIND_INFO[f.kind].label, set()).add(f.rank)
            what = ", ".join(f"{label} ×{len(ranks)}" for label, ranks in counts.items())
            parts.append(f"The other ranks' errors ({what}) are consequences.")
        extra = sorted({f.rank for f in others if f.primary and f.severity == "error" and f.rank is not None})
        if extra:
            kinds = sorted({_KIND_INFO[f.kind].label for f in others if f.primary and f.severity == "error"})
            many = len(extra) > 1
            parts.append(
                f"Rank{'s' if many else ''} {_join(extra)} also report{'' if many else 's'} {', '.join(kinds)}."
            )
        silent = [r for r in self.silent_ranks if r != self.first_rank]
        if silent and self.basis in ("timeout", "lowest_rank"):
            parts.append(
                f"Rank{'s' if len(silent) > 1 else ''} {_join(silent)} left no error: a rank that hung or was killed "
                "without a message is the likely culprit (check its exit code, `dmesg`, `py-spy dump`)."
            )
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return {
            "first_rank": self.first_rank, "basis": self.basis,
            "root": self.root.to_dict() if self.root else None,
            "findings": [f.to_dict() for f in self.findings],
            "ranks": {str(r): {"findings": [f.to_dict() for f in fs], "facts": self.facts[r].to_dict()}
                      for r, fs in sorted(self.by_rank.items())},
            "suspects": list(self.suspects), "silent_ranks": list(self.silent_ranks), "summary": self.summary(),
            "hang": self.hang,
            "early_exit": self.early_exit,
        }  # fmt: skip


def _join(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


_WEAK_CAUSES = frozenset({"socket_connect", "store_unreachable", "nccl_error"})


def diagnose_ranks(
    logs: Mapping[int, str],
    exit_times: Mapping[int, float] | None = None,
    *,
    exit_codes: Mapping[int, int] | None = None,
) -> Diagnosis:
    """Classify every rank's log, find the rank that failed first and put its root cause first.

    The first failing rank is the failing rank with the earliest ``exit_times`` entry when given; else the lowest
    rank with a root cause (an exception, OOM, a configuration error...); else a rank that a timeout report
    (monitored barrier, desync report, missing ranks) names; else the lowest rank that timed out; else the lowest
    rank with any error. ``exit_codes`` (e.g. from :func:`parse_child_failures`) adds a finding for ranks that
    died without a message (-9: OOM killer, -11: segfault, -15: stopped by the launcher...).
    """
    by_rank: dict[int, list[Finding]] = {}
    facts: dict[int, NcclFacts] = {}
    for r in sorted(logs):
        fs = classify(logs[r], rank=r)
        code = (exit_codes or {}).get(r)
        has_error = any(f.severity == "error" for f in fs)
        if code and not any(f.severity == "error" and f.primary for f in fs):
            if not has_error or (code < 0 and code not in (-15, -2, -1)):
                fs = sorted([*fs, _exit_finding(r, code)], key=_sort_key)
        by_rank[r] = fs
        facts[r] = nccl_facts(logs[r])
    for r, code in (exit_codes or {}).items():
        if r not in by_rank and code:
            by_rank[r], facts[r] = [_exit_finding(r, code)], NcclFacts()

    def errors(r: int, role: str | None = None) -> list[Finding]:
        return [f for f in by_rank.get(r, ()) if f.severity == "error" and (role is None or f.role == role)]

    failing = [r for r in sorted(by_rank) if errors(r)]
    cause_ranks = [r for r in failing if errors(r, "cause")]
    hang_ranks = [r for r in failing if errors(r, "hang")]
    suspects = sorted({s for fs in by_rank.values() for f in fs if f.role == "hang" for s in f.suspects})
    silent = [r for r in sorted(by_rank) if not errors(r)] if failing else []

    first: int | None = None
    root: Finding | None = None
    basis = "none"
    timed = [r for r in failing if exit_times and r in exit_times]
    if exit_times and timed:
        first, basis = min(timed, key=lambda r: (exit_times[r], r)), "exit_time"
    elif cause_ranks:
        # a rank with a definite cause beats one whose "cause" is often a side effect (cannot connect, generic NCCL)
        first = min(cause_ranks, key=lambda r: (all(f.kind in _WEAK_CAUSES for f in errors(r, "cause")), r))
        basis = "cause"
    elif suspects:
        first, basis = suspects[0], "named"
        own = [f for f in errors(first) if f.primary]
        if own:
            root = own[0]
        else:  # the named rank left no error: the report that names it is the root finding
            root = min((f for fs in by_rank.values() for f in fs if first in f.suspects), key=_sort_key)
    elif hang_ranks:
        first, basis = hang_ranks[0], "timeout"
    elif failing:
        first, basis = failing[0], "lowest_rank"
    if first is not None and root is None:
        own = errors(first)
        root = own[0] if own else None

    # once the first rank is known, the other ranks' timeouts are waits for it: consequences (unless every
    # failing rank only timed out and nothing says who is late)
    if first is not None and basis != "timeout":
        for r, fs in by_rank.items():
            if r != first:
                by_rank[r] = sorted(
                    (replace(f, primary=False) if f.role == "hang" and f is not root else f for f in fs), key=_sort_key
                )

    def order(f: Finding) -> tuple[int, int, tuple[int, int, int, int, int], int]:
        return (0 if f is root else 1, 0 if f.rank == first else 1, _sort_key(f), f.rank if f.rank is not None else -1)

    findings = sorted((f for fs in by_rank.values() for f in fs), key=order)
    return Diagnosis(first_rank=first, root=root, findings=findings, by_rank=by_rank, facts=facts, basis=basis,
                     suspects=suspects, silent_ranks=silent)  # fmt: skip


def split_by_rank(text: str) -> dict[int, str]:
    """Split one combined stream (torchrun's own output, a SkyPilot/SLURM log) by its ``[rank<k>]:`` prefixes.

    Lines without a rank prefix are left out (NCCL's own lines carry none; torchrun's ``--tee`` prefix
    ``[default<k>]:`` is the *local* rank, not the global one).
    """
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        r = _line_rank(line)
        if r is not None:
            out.setdefault(r, []).append(line)
    return {r: "\n".join(ls) for r, ls in sorted(out.items())}


# torchrun's ChildFailedError table (elastic/multiprocessing/errors/__init__.py):
#   [1]:
#     time      : 2026-11-22_06:29:09
#     host      : localhost
#     rank      : 0 (local_rank: 0)
#     exitcode  : -15 (pid: 15701)  (SIGTERM)
_CHILD_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_CHILD_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def parse_child_failures(text: str) -> dict[int, int]:
    """Exit codes per global rank from torchrun's ``ChildFailedError`` summary (empty when there is none)."""
    out: dict[int, int] = {}
    rank: int | None = None
    for line in text.splitlines():
        body = _strip(line)
        if m := _CHILD_RANK.match(body):
            rank = int(m.group(1))
        elif (m := _CHILD_EXIT.match(body)) and rank is not None:
            out[rank] = int(m.group(1))
            rank = None
    return out
