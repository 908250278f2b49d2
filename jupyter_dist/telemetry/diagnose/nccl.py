"""NCCL's debug line format: :func:`parse_nccl_line` reads one line, :func:`nccl_facts` summarises the init lines.

Part of :mod:`jupyter_dist.telemetry.diagnose` (the rules that classify failures are in :mod:`.patterns`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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
RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
# "[default0]:" (torchrun --tee/--role, local rank), "[rank0]:" (excepthook installed by init_process_group),
# "(RayWorkerWrapper pid=123, ip=10.0.0.1)" (Ray), one each at most, in that order.
LINE_PREFIXES = re.compile(r"^(?:\[[A-Za-z_][\w\-]*?\d+\]: ?)?(?:\[rank\d+\]: ?)?(?:\([\w]+ pid=\d+[^)]*\) ?)?")


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
    rank_m = RANK_PREFIX.search(line[: m.start("host") + 1])
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


