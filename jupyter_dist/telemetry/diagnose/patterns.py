"""The failure table: every kind with its role and fix (:data:`KIND_INFO`), the ordered rules (:data:`RULES`).

Every pattern carries a comment naming the source that emits the message and its format string; the golden tests in
``tests/test_diagnose.py`` reproduce complete logs in those formats. One piece on purpose (about 600 lines): it is a
table read top to bottom, ordered so that the first matching rule wins. :mod:`.engine` applies it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


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

KIND_INFO: dict[str, _Kind] = {
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

KINDS: tuple[str, ...] = tuple(KIND_INFO)
"""Every finding kind, most specific first."""

PRIORITY = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class Hit:
    """What a rule's describer read from one matching message (the kind, its title, parsed values)."""

    kind: str
    title: str
    data: Mapping[str, Any] = field(default_factory=dict)
    suspects: tuple[int, ...] = ()


_Describe = Callable[[re.Match[str]], Hit]


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
    return lambda m: Hit(kind, title)


def _nccl_timeout(m: re.Match[str]) -> Hit:
    line = m.string
    op, seq = _field(r"OpType=(\w+)", line), _field(r"SeqNum=(\d+)", line)
    timeout, ran = _field(r"Timeout\(ms\)=(\d+)", line), _field(r"ran for (\d+) milliseconds", line)
    data: dict[str, Any] = {k: v for k, v in (("op", op), ("seq", seq), ("timeout_ms", timeout), ("ran_ms", ran)) if v}
    title = "NCCL collective timed out"
    if op:
        title += f": {op}" + (f" #{seq}" if seq else "")
    if ran or timeout:
        title += f" ran {ran or '?'} ms (timeout {timeout or '?'} ms)"
    return Hit("nccl_timeout", title, data)


def _gloo_timeout(m: re.Match[str]) -> Hit:
    return Hit("gloo_timeout", f"gloo {m['op']} timed out after {m['ms']} ms waiting for a peer",
                {"op": m["op"], "timeout_ms": int(m["ms"])})  # fmt: skip


def _monitored(m: re.Match[str]) -> Hit:
    ranks = _ranks(m["ranks"])
    who = ", ".join(map(str, ranks))
    return Hit("monitored_barrier", f"rank {who} did not reach the monitored barrier within {m['ms']} ms",
                {"timeout_ms": int(m["ms"])}, suspects=ranks)  # fmt: skip


def _monitored_peer(m: re.Match[str]) -> Hit:
    r = int(m["rank"])
    return Hit("monitored_barrier", f"monitored barrier: errors waiting for rank {r} (check rank {r}'s log)",
                suspects=(r,))  # fmt: skip


def _desync_missing(m: re.Match[str]) -> Hit:
    ranks = _ranks(m["ranks"])
    return Hit("desync", f"desync report: ranks {list(ranks)} never joined the collective", suspects=ranks)


def _desync_lagging(m: re.Match[str]) -> Hit:
    ranks = _ranks(m["ranks"])
    return Hit("desync", f"desync report: ranks {list(ranks)} did not join collective #{m['seq']}",
                suspects=ranks)  # fmt: skip


def _mismatch(m: re.Match[str]) -> Hit:
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
    return Hit("collective_mismatch", title, {"aspects": aspects} if aspects else {})


def _ib_completion(m: re.Match[str]) -> Hit:
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
        return Hit("ib_retry_exceeded", f"IB transport retry exceeded{frm} (status {status} {name})".rstrip(), data)
    if status == 5:
        # flushed work requests: the queue pair was already in error (a consequence of another failure)
        return Hit("peer_closed", f"IB work requests flushed{frm} (queue pair in error after a failure)", data)
    return Hit("ib_completion_error", f"IB completion error{frm} (status {status} {name})".rstrip(), data)


def _shm(m: re.Match[str]) -> Hit:
    size = m.groupdict().get("size")
    data = {"size": int(size)} if size else {}
    what = f" of {int(size) / 2**20:.1f} MiB" if size else ""
    return Hit("shm_too_small", f"cannot create a shared-memory segment{what} in /dev/shm", data)


def _oom(m: re.Match[str]) -> Hit:
    line = m.string
    tried = _field(r"Tried to allocate ([\d.]+ [KMGT]i?B)", line)
    gpu = _field(r"GPU (\d+)", line)
    title = "CUDA out of memory" + (f" on GPU {gpu}" if gpu else "")
    title += f" (tried to allocate {tried})" if tried else ""
    if "Cuda failure" in line:
        title = "NCCL: CUDA out of memory while allocating its buffers"
    return Hit("cuda_oom", title, {k: v for k, v in (("tried", tried), ("gpu", gpu)) if v})


def _cuda_error(m: re.Match[str]) -> Hit:
    what = m.group("what") if m.group("what") is not None else m.group("what2")
    if what is None:
        return Hit("cuda_error", "NCCL: unhandled CUDA error")
    what = what.strip().rstrip(".")
    if "out of memory" in what:
        return Hit("cuda_oom", "CUDA out of memory")
    return Hit("cuda_error", f"CUDA error: {what}", {"error": what})


def _version_mismatch(m: re.Match[str]) -> Hit:
    def v(code: str) -> str:
        c = int(code)
        major, rest = (c // 10000, c % 10000) if c >= 20900 else (c // 1000, c % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"

    return Hit("nccl_version_mismatch",
                f"NCCL version mismatch: rank {m['r1']} has {v(m['v1'])}, rank {m['r2']} has {v(m['v2'])}",
                {"versions": {int(m["r1"]): v(m["v1"]), int(m["r2"]): v(m["v2"])}})  # fmt: skip


def _peer(title: str) -> _Describe:
    def describe(m: re.Match[str]) -> Hit:
        peer = m.groupdict().get("peer")
        return Hit("peer_closed", title + (f" ({peer})" if peer else ""), {"peer": peer} if peer else {})

    return describe


def _nccl_error(m: re.Match[str]) -> Hit:
    what = (m.groupdict().get("what") or m.group(0)).strip().rstrip(",")
    return Hit("nccl_error", f"NCCL error: {what}", {"error": what})


def _port(m: re.Match[str]) -> Hit:
    port = _field(r"port: (\d+)", m.string) or _field(r"\]:(\d+) ", m.string)
    return Hit("port_in_use", "address already in use" + (f" (port {port})" if port else ""),
                {"port": int(port)} if port else {})  # fmt: skip


def _store_unreachable(m: re.Match[str]) -> Hit:
    host, port = m["host"], m["port"]
    return Hit("store_unreachable", f"cannot reach the TCPStore at {host}:{port}", {"host": host, "port": int(port)})


def _clients_joined(m: re.Match[str]) -> Hit:
    return Hit("rendezvous_timeout", f"only {m['n']}/{m['w']} ranks joined within {m['s']} s",
                {"joined": int(m["n"]), "world_size": int(m["w"])})  # fmt: skip


def _missing_ranks(m: re.Match[str]) -> Hit:
    ranks = _ranks(m["ranks"]) if re.fullmatch(r"[\d,\s]*", m["ranks"]) else ()
    return Hit("rendezvous_timeout", f"barrier timed out; missing ranks [{m['ranks']}]", suspects=ranks)


def _signal(m: re.Match[str]) -> Hit:
    sig = m.groupdict().get("sig")
    return Hit("terminated", "terminated by signal" + (f" {sig}" if sig else "") + " (stopped by the launcher)")


# Cheap prefilter: a line reaches the rules below only if it contains one of these (lower-case) words. Every rule's
# pattern contains at least one of them: keep the two in step when adding a rule.
KEYWORDS = (
    "monitoredbarrier", "lagging", "didn't join", "mismatch", "timeout", "timed out", "heartbeat monitor",
    "watchdog", "socket", "eaddrinuse", "already in use", "completion", "ibv_", "shared memory", "/dev/shm",
    "posix_fallocate", "bus error", "interface", "unable to find address", "unable to resolve hostname",
    "connect", "out of memory", "outofmemory", "killed", "oom-kill", "cuda", "nccl", "remote process",
    "entire process", "signalexception", "keyboardinterrupt", "childfailederror", "system error", "internal error",
)  # fmt: skip
# NCCL's INFO/TRACE/CALL lines report progress, never a failure (its failures are WARN lines)
NCCL_CHATTER = re.compile(r"\d+:\d+:\d+ (?:\[-?\d+\] (?:[\d.]+ \S+:\d+ )?)?NCCL (?:INFO|TRACE|CALL) ")

# Ordered: the first rule that matches a line wins, so specific messages come before generic ones.
RULES: tuple[_Rule, ...] = tuple(
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
            lambda m: Hit("registration_failure", f"{m['call']} failed (NIC memory registration / QP creation)"),
        ),
        # NCCL bootstrap.cc: WARN("Bootstrap : no socket interface found"); net_socket.cc: WARN("NET/Socket : no
        # interface found"); gloo transport/tcp/device.cc: "Unable to find address for: eth0"
        (
            r"no socket interface found|NET/Socket : no interface found",
            _static("socket_ifname", "NCCL found no usable network interface"),
        ),
        (
            r"Unable to find address for:? (?P<ifname>\S+)",
            lambda m: Hit("socket_ifname", f"gloo: interface {m['ifname']} not found", {"ifname": m["ifname"]}),
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
            lambda m: Hit(
                "socket_connect", "NCCL could not connect to a peer" + (f" at {m['peer']}" if m["peer"] else "")
            ),
        ),  # fmt: skip
        (r"Gloo connectFullMesh failed", _static("socket_connect", "gloo could not connect the full mesh of ranks")),
        (
            r"connect \[(?P<peer>[^\]]+)\]:\d+: (?:Connection refused|No route to host|Connection timed out)",
            lambda m: Hit("socket_connect", f"gloo could not connect to {m['peer']}"),
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


