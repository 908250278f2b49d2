"""Golden tests for jupyter_dist.telemetry.diagnose: logs in the real formats of NCCL, ProcessGroupNCCL/Gloo,
TCPStore and torchrun, plus one real 2-process gloo failure run with torchrun.

The gloo, TCPStore and torchrun fixtures were captured from runs of the installed torch (CPU); the NCCL and
ProcessGroupNCCL ones reproduce the format strings of NCCL's src/debug.cc, misc/shmutils.cc, transport/net_ib.cc,
bootstrap.cc, init.cc and torch's ProcessGroupNCCL.cpp / NCCLUtils.cpp (see the comments in telemetry/diagnose/patterns.py).
Log lines are kept whole, as the programs print them: hence no line-length limit in this file.
"""

# ruff: noqa: E501

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jupyter_dist.telemetry.diagnose import (
    KINDS,
    Finding,
    classify,
    diagnose_ranks,
    nccl_facts,
    parse_child_failures,
    parse_nccl_line,
    split_by_rank,
)

# ----------------------------------------------------------------------------------------------- fixtures
GLOO_PEER_CLOSED_RUN = """\

*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
[default1]:[rank1]: Traceback (most recent call last):
[default1]:[rank1]:   File "/tmp/exp/s1.py", line 10, in <module>
[default1]:[rank1]:     raise RuntimeError("boom: bad batch on rank 1")
[default1]:[rank1]: RuntimeError: boom: bad batch on rank 1
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "/tmp/exp/s1.py", line 11, in <module>
[default0]:[rank0]:     dist.all_reduce(t)
[default0]:[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
[default0]:[rank0]:     return func(*args, **kwargs)
[default0]:[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[default0]:[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[default0]:[rank0]:     work.wait()
[default0]:[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6368. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f
W1122 06:29:09.534000 15696 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15701 closing signal SIGTERM
E1122 06:29:09.566000 15696 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 15702) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
s1.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_06:29:09
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 15701)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 15701
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_06:29:09
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 15702)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

OOM_RANK = """\
[rank3]:[W1122 10:30:59.118 ProcessGroupNCCL.cpp:4561] [PG ID 0 PG GUID 0 Rank 3]  using GPU 3 to perform barrier as devices used by this process are currently unknown.
step 2050 loss 2.3114 lr 3.0e-04
[rank3]: Traceback (most recent call last):
[rank3]:   File "/workspace/train.py", line 88, in <module>
[rank3]:     loss.backward()
[rank3]:   File "/usr/local/lib/python3.11/site-packages/torch/_tensor.py", line 626, in backward
[rank3]:     torch.autograd.backward(
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.15 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this process has 78.09 GiB memory in use. Of the allocated memory 74.10 GiB is allocated by PyTorch, and 2.51 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""


def nccl_timeout_rank(r: int, glued: bool = False) -> str:
    """ProcessGroupNCCL's watchdog output (torch 2.4+ format) for a rank stuck in all-reduce #2051."""
    work = "WorkNCCL(SeqNum=2051, OpType=ALLREDUCE, NumelIn=65536000, NumelOut=65536000, Timeout(ms)=600000)"
    pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {r}]"
    first = f"[rank{r}]:[E1122 10:41:02.123456789 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: {work} ran for 600047 milliseconds before timing out."
    if glued:  # stderr interleaving: the watchdog line glued to the end of a progress bar
        first = "  7%|▋         | 2050/30000 [41:02<9:18:30,  1.20s/it]" + first
    return "\n".join([
        "step 2050 loss 2.3120 lr 3.0e-04",
        first,
        f"[rank{r}]:[E1122 10:41:02.124 ProcessGroupNCCL.cpp:2271] {pg} failure detected by watchdog at work sequence id: 2051 PG status: last enqueued work: 2051, last completed work: 2050",
        f"[rank{r}]:[E1122 10:41:02.124 ProcessGroupNCCL.cpp:670] Stack trace of the failed collective not found, potentially because FlightRecorder is disabled. You can enable it by setting TORCH_NCCL_TRACE_BUFFER_SIZE to a non-zero value.",
        f"[rank{r}]:[E1122 10:41:02.124 ProcessGroupNCCL.cpp:684] [Rank {r}] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
        f"[rank{r}]:[E1122 10:41:02.124 ProcessGroupNCCL.cpp:698] [Rank {r}] To avoid data inconsistency, we are taking the entire process down.",
        f"[rank{r}]:[E1122 10:41:02.125 ProcessGroupNCCL.cpp:1899] {pg} Process group watchdog thread terminated with exception: [Rank {r}] Watchdog caught collective operation timeout: {work} ran for 600047 milliseconds before timing out.",
        "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f3e5b56c446 in /usr/local/lib/python3.11/site-packages/torch/lib/libc10.so)",
        "frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x282 (0x7f3e5c8b4772 in /usr/local/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so)",
        "",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        f"  what():  {pg} Process group watchdog thread terminated with exception: [Rank {r}] Watchdog caught collective operation timeout: {work} ran for 600047 milliseconds before timing out.",
        "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635 (most recent call first):",
    ]) + "\n"  # fmt: skip


def nccl_init(host: str, pid: int, dev: int, rank: int, *, nranks: int = 16, nnodes: int = 2, ib: bool = True) -> str:
    """NCCL_DEBUG=INFO init lines of one rank (NCCL 2.21 formats)."""
    p = f"{host}:{pid}:{pid} [{dev}] NCCL INFO"
    net = (
        f"{p} NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ens1:10.0.0.{dev + 1}<0>\n{p} Using network IB"
        if ib
        else f"{p} NET/IB : No device found.\n{p} NET/Socket : Using [0]ens1:10.0.0.{dev + 1}<0>\n{p} Using network Socket"
    )
    transport = "NET/IB/0/GDRDMA" if ib else "NET/Socket/0"
    return textwrap.dedent(f"""\
        {p} Bootstrap : Using ens1:10.0.0.{dev + 1}<0>
        {p} cudaDriverVersion 12040
        {p} NCCL version 2.21.5+cuda12.4
        {p} NET/Plugin : dlerror=libnccl-net.so: cannot open shared object file: No such file or directory No plugin found (libnccl-net.so), using internal implementation
        {net}
        {p} ncclCommInitRank comm 0x55d1c2a0 rank {rank} nranks {nranks} cudaDev {dev} nvmlDev {dev} busId 18000 commId 0x6b1d4a1c2d3e4f50 - Init START
        {p} Setting affinity for GPU {dev} to ffffffff,00000000
        {p} comm 0x55d1c2a0 rank {rank} nRanks {nranks} nNodes {nnodes} localRanks 8 localRank {dev} MNNVL 0
        {p} Channel 00/02 :    0   7   6   5   4   3   2   1   8  15  14  13  12  11  10   9
        {p} Trees [0] 1/8/-1->0->-1 [1] 1/-1/-1->0->8
        {p} P2P Chunksize set to 131072
        {p} Channel 00/0 : {rank}[{dev}] -> {rank + 1}[{dev + 1}] via P2P/CUMEM/read
        {p} Channel 01/0 : 15[7] -> {rank}[{dev}] [receive] via {transport}
        {p} Channel 01/0 : {rank}[{dev}] -> 8[0] [send] via {transport}
        {p} Connected all rings
        {p} Connected all trees
        {p} threadThresholds 8/8/64 | 128/8/64 | 512 | 512
        {p} ncclCommInitRank comm 0x55d1c2a0 rank {rank} nranks {nranks} cudaDev {dev} nvmlDev {dev} busId 18000 commId 0x6b1d4a1c2d3e4f50 - Init COMPLETE
        """)


DIST_BACKEND_REMOTE = """\
[rank{r}]: Traceback (most recent call last):
[rank{r}]:   File "/workspace/train.py", line 61, in <module>
[rank{r}]:     dist.all_reduce(loss)
[rank{r}]:   File "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501, in all_reduce
[rank{r}]:     work.wait()
[rank{r}]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2027, remote process exited or there was a network error, NCCL version 2.21.5
[rank{r}]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
[rank{r}]: Last error:
[rank{r}]: socketProgress: Connection closed by remote peer node-b.cluster.internal<53514>
"""

SHM_RANK = """\
3d3e22c3066f:168:168 [0] NCCL INFO Bootstrap : Using eth0:172.17.0.2<0>
3d3e22c3066f:168:168 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
3d3e22c3066f:168:168 [0] NCCL INFO comm 0x5581a86a1830 rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0

3d3e22c3066f:168:168 [0] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-UbzKZ9 to 9637892 bytes, error: No space left on device (28)

3d3e22c3066f:168:168 [0] misc/shmutils.cc:113 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-UbzKZ9 (size 9637888), error: No space left on device (28)
3d3e22c3066f:168:168 [0] NCCL INFO transport/shm.cc:114 -> 2
3d3e22c3066f:168:168 [0] NCCL INFO transport.cc:33 -> 2
3d3e22c3066f:168:168 [0] NCCL INFO init.cc:1263 -> 2
[rank0]: Traceback (most recent call last):
[rank0]:   File "/app/train.py", line 40, in <module>
[rank0]:     model = DDP(model, device_ids=[local_rank])
[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5
[rank0]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
[rank0]: Last error:
[rank0]: Error while creating shared memory segment /dev/shm/nccl-UbzKZ9 (size 9637888), error: No space left on device (28)
"""

IFNAME_RANK = """\
node-a:5776:5776 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth1

node-a:5776:5776 [0] bootstrap.cc:144 NCCL WARN Bootstrap : no socket interface found
node-a:5776:5776 [0] NCCL INFO init.cc:1705 -> 3
[rank0]: Traceback (most recent call last):
[rank0]:   File "/workspace/train.py", line 22, in <module>
[rank0]:     dist.barrier()
[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, internal error - please report this issue to the NCCL developers, NCCL version 2.19.3
[rank0]: ncclInternalError: Internal check failed.
[rank0]: Last error:
[rank0]: Bootstrap : no socket interface found
"""

IB_WARNS = {
    # NCCL <= 2.18 (transport/net_ib.cc): "with error %d, opcode %d, len %d, vendor err %d (%s)"
    "old": "node-a:5776:5902 [0] transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion from peer 10.2.0.5<33092> with error 12, opcode 0, len 0, vendor err 129 (Recv)",
    # NCCL 2.19-2.2x: "with status=%d opcode=%d len=%d vendor err %d (%s)%s%s%s%s hca %s", timestamp on WARN
    "mid": "[2026-03-03 12:11:38] node-a:185303:186751 [1] transport/net_ib.cc:2453 NCCL WARN NET/IB : Got completion from peer 10.99.91.63<51161> with status=12 opcode=129 len=524288 vendor err 129 (Recv) localGid ::ffff:10.99.92.59 remoteGids::ffff:10.99.91.63 hca mlx5_1",
    # newest: "status=%s(%d) opcode=%s(%d) vendor_err=%u", file path under transport/net_ib/
    "new": "[2026-09-09 10:46:33] node-a:319733:319761 [1] transport/net_ib/p2p.cc:648 NCCL WARN NET/IB: Got completion from peer 10.153.235.13<40554> with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV_RDMA_WITH_IMM(129) vendor_err=129 localGid ::ffff:1.1.2.2 remoteGids::ffff:1.1.1.4 hca mlx5_1",
}  # fmt: skip

MONITORED_BARRIER_RANK0 = """\
[rank0]:[E1122 06:30:05.030794118 ProcessGroupGloo.cpp:67] [Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/exp/s1.py", line 34, in <module>
[rank0]:     dist.monitored_barrier(timeout=timedelta(seconds=3))
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5435, in monitored_barrier
[rank0]:     return group_to_use.monitored_barrier(  # type:ignore[attr-defined]
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms
[rank0]:  Original exception:
[rank0]: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete
"""

GLOO_TIMEOUT_RANK0 = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/exp/s1.py", line 20, in <module>
[rank0]:     dist.all_reduce(t)
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete
"""

MISMATCH = {
    0: """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/exp/s1.py", line 25, in <module>
[rank0]:     dist.all_reduce(t)
[rank0]: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))).Collectives differ in the following aspects: \t Op type: ALLREDUCEvs BROADCAST
""",
    1: """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/exp/s1.py", line 23, in <module>
[rank1]:     dist.broadcast(t, 0)
[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))), but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))).Collectives differ in the following aspects: \t Op type: BROADCASTvs ALLREDUCE
""",
}  # fmt: skip

PORT_IN_USE = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 189, in _create_c10d_store
    return TCPStore(
           ^^^^^^^^^
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29517, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use
"""

STORE_CLIENT_TIMEOUT = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 189, in _create_c10d_store
    return TCPStore(
           ^^^^^^^^^
torch.distributed.DistNetworkError: The client socket has timed out after 4000ms while trying to connect to (10.0.0.1, 29534).
"""

STORE_SERVER_TIMEOUT = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 189, in _create_c10d_store
    return TCPStore(
           ^^^^^^^^^
torch.distributed.DistStoreError: Timed out after 5 seconds waiting for clients. 1/2 clients joined.
"""

# NCCL_DEBUG=INFO chatter, torchrun banners and user prints that mention the same words as real failures
NOISE = (
    nccl_init("gpu-node-1", 4242, 0, 0)
    + """\
gpu-node-1:4242:4242 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to ens1
gpu-node-1:4242:4242 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 22.
gpu-node-1:4242:4290 [0] NCCL INFO [Service thread] Connection closed by localRank 1
gpu-node-1:4242:4242 [0] NCCL INFO comm 0x55d1c2a0 rank 0 nranks 16 cudaDev 0 busId 18000 - Destroy COMPLETE
W1122 06:29:00.100000 15696 torch/distributed/run.py:803] Setting OMP_NUM_THREADS environment variable for each process to be 1 in default
[rank0]:[W1122 06:29:01.000 ProcessGroupNCCL.cpp:4561] [PG ID 0 PG GUID 0 Rank 0]  using GPU 0 to perform barrier as devices used by this process are currently unknown. This can potentially cause a hang if this rank to GPU mapping is incorrect.
epoch 3: timeout=1800 s, eval loss 1.23 (no connection errors, no out of memory, peer review pending)
/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: UserWarning: This DataLoader will create 16 worker processes in total.
step 100 | loss 2.10 | shm usage 12% | grad_norm 0.8
"""
)


# --------------------------------------------------------------------------------------------- NCCL lines
@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("node1:1234:1234 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
         ("node1", 1234, 1234, 0, "INFO", "NCCL version 2.21.5+cuda12.4", None, None)),
        ("node1:1234:1290 [3] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.2<35045> failed : Connection refused",
         ("node1", 1234, 1290, 3, "WARN", "socketStartConnect: Connect to 10.0.0.2<35045> failed : Connection refused",
          "misc/socket.cc:484", None)),
        ("[2026-03-03 12:11:38] tpgds-aihub0007:185303:186751 [1] transport/net_ib.cc:2453 (ncclIbTest) NCCL WARN NET/IB: x",
         ("tpgds-aihub0007", 185303, 186751, 1, "WARN", "NET/IB: x", "transport/net_ib.cc:2453 (ncclIbTest)", None)),
        ("[default2]:[rank10]:node-b.cluster.internal:77:77 [2] NCCL INFO Using network IB",
         ("node-b.cluster.internal", 77, 77, 2, "INFO", "Using network IB", None, 10)),
        ("node1:1234:1234 [0] 1234.567890 ncclAllReduce:68 NCCL TRACE opCount 0 sendbuff 0x7f",
         ("node1", 1234, 1234, 0, "TRACE", "opCount 0 sendbuff 0x7f", "1234.567890 ncclAllReduce:68", None)),
        ("node1:1234:1234 NCCL CALL ncclCommInitRank(0x7ff,2,0x1,0)",
         ("node1", 1234, 1234, None, "CALL", "ncclCommInitRank(0x7ff,2,0x1,0)", None, None)),
    ],
)  # fmt: skip
def test_parse_nccl_line_formats(line: str, expect: tuple[object, ...]) -> None:
    parsed = parse_nccl_line(line)
    assert parsed is not None
    got = (parsed.host, parsed.pid, parsed.tid, parsed.device, parsed.level, parsed.message, parsed.source, parsed.rank)
    assert got == expect


@pytest.mark.parametrize(
    "line",
    [
        "NCCL version 2.21.5+cuda12.4",  # VERSION level: no host prefix (facts still read it)
        "[2026-04-28 14:14:48] 12:11:38 NCCL INFO x",  # a time is not host:pid:tid [dev]
        "epoch 1 NCCL INFO looks like it but is not",
        "[rank0]:[E1122 10:41:02.123 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout",
    ],
)
def test_parse_nccl_line_rejects_other_lines(line: str) -> None:
    assert parse_nccl_line(line) is None


def test_nccl_facts_multi_node_ib() -> None:
    log = nccl_init("gpu-node-1", 4242, 0, 0) + IB_WARNS["mid"] + "\n"
    facts = nccl_facts(log)
    assert facts.version == "2.21.5+cuda12.4"
    assert facts.network == "IB"
    assert facts.transports == {"P2P", "NET/IB"}
    assert facts.gdr is True
    assert (facts.nranks, facts.nnodes, facts.local_ranks) == (16, 2, 8)
    assert facts.interfaces == ["mlx5_0:1/IB", "mlx5_1:1/IB"]
    assert facts.bootstrap == "ens1:10.0.0.1<0>"
    assert facts.init_complete is True
    assert len(facts.warnings) == 1 and facts.warnings[0].startswith("NET/IB : Got completion from peer")
    json.dumps(facts.to_dict())


def test_nccl_facts_socket_and_shm_and_version_line() -> None:
    log = nccl_init("n", 1, 0, 0, nranks=8, nnodes=2, ib=False)
    log += "n:1:1 [0] NCCL INFO Channel 02/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
    facts = nccl_facts(log)
    assert facts.network == "Socket" and facts.transports == {"P2P", "SHM", "NET/Socket"} and not facts.gdr
    assert facts.interfaces == ["ens1:10.0.0.1<0>"]
    # NCCL_DEBUG=VERSION prints the bare line; torch appends ", NCCL version X" to its NCCL errors
    assert nccl_facts("NCCL version 2.19.3+cuda12.3\n").version == "2.19.3+cuda12.3"
    assert nccl_facts(IFNAME_RANK).version == "2.19.3"
    assert nccl_facts("no nccl here\n") == nccl_facts("")


# ------------------------------------------------------------------------------------------- classify
def kinds(findings: list[Finding]) -> list[str]:
    return [f.kind for f in findings]


def test_noise_triggers_nothing() -> None:
    assert classify(NOISE) == []
    d = diagnose_ranks({0: NOISE, 1: NOISE})
    assert d.first_rank is None and d.root is None and d.basis == "none"
    assert d.summary() == "No communication or rank errors found in 2 rank logs."


def test_rank_exception_and_gloo_peer_closed_from_torchrun_output() -> None:
    logs = split_by_rank(GLOO_PEER_CLOSED_RUN)
    assert sorted(logs) == [0, 1]
    r1, r0 = classify(logs[1]), classify(logs[0])
    assert kinds(r1) == ["rank_exception"] and r1[0].primary and r1[0].rank == 1
    assert r1[0].title == "RuntimeError: boom: bad batch on rank 1"
    assert 'raise RuntimeError("boom' in r1[0].evidence[0] or "s1.py" in r1[0].evidence[0]
    assert kinds(r0) == ["peer_closed"] and not r0[0].primary and r0[0].data["peer"] == "127.0.0.1"
    # torchrun's table gives the exit codes; its "Root Cause" (first exit the agent saw) is not trusted
    assert parse_child_failures(GLOO_PEER_CLOSED_RUN) == {0: -15, 1: 1}
    d = diagnose_ranks(logs, exit_codes=parse_child_failures(GLOO_PEER_CLOSED_RUN))
    assert d.first_rank == 1 and d.root is not None and d.root.kind == "rank_exception" and d.basis == "cause"
    assert [f.rank for f in d.findings] == [1, 0]
    assert "peer closed ×1" in d.summary()
    # the agent's own ChildFailedError traceback is a summary, not a rank exception
    agent = classify(GLOO_PEER_CLOSED_RUN)
    assert "child_failed" not in kinds([f for f in agent if f.rank is None]) or all(
        f.severity == "info" for f in agent if f.kind == "child_failed"
    )
    assert {(f.kind, f.rank) for f in agent if f.severity == "error"} == {("rank_exception", 1), ("peer_closed", 0)}


def test_oom_rank_is_first_and_watchdog_timeouts_are_consequences() -> None:
    logs = {r: nccl_timeout_rank(r, glued=(r == 5)) for r in range(8) if r != 3}
    logs[3] = OOM_RANK
    d = diagnose_ranks(logs)
    assert d.first_rank == 3 and d.basis == "cause"
    assert d.root is not None and d.root.kind == "cuda_oom" and d.root.rank == 3
    assert d.root.title == "CUDA out of memory on GPU 3 (tried to allocate 2.00 GiB)"
    assert "expandable_segments" in d.root.fix
    assert d.findings[0] is d.root
    timeouts = [f for f in d.findings if f.kind == "nccl_timeout"]
    assert sorted(f.rank for f in timeouts) == [0, 1, 2, 4, 5, 6, 7]
    assert all(not f.primary and f.role == "hang" for f in timeouts)
    assert timeouts[0].data == {"op": "ALLREDUCE", "seq": "2051", "timeout_ms": "600000", "ran_ms": "600047"}
    assert timeouts[0].title == "NCCL collective timed out: ALLREDUCE #2051 ran 600047 ms (timeout 600000 ms)"
    # the abort lines that follow a timeout are the same failure: not reported again
    assert all(f.kind == "nccl_timeout" for f in d.findings[1:])
    s = d.summary()
    assert s.startswith("Rank 3 failed first: CUDA out of memory on GPU 3")
    assert "The other ranks' errors (NCCL timeout ×7) are consequences." in s
    json.dumps(d.to_dict())


def test_nccl_timeout_everywhere_without_a_cause() -> None:
    logs = {r: nccl_timeout_rank(r) for r in range(4)}
    logs[2] = "step 2050 loss 2.3120\n"  # rank 2 never reached the all-reduce and left no error
    d = diagnose_ranks(logs)
    assert d.basis == "timeout" and d.first_rank == 0 and d.root is not None and d.root.kind == "nccl_timeout"
    assert d.silent_ranks == [2]
    assert all(f.primary for f in d.findings)
    s = d.summary()
    assert "Ranks 1, 3 also report NCCL timeout." in s and "Rank 2 left no error" in s
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in d.root.fix


def test_desync_report_names_the_lagging_rank() -> None:
    report = (
        "\n\t - [0] Timeout at collective: ALLREDUCE, #2051"
        "\n\t - To our best knowledge, ranks [2] are the lagging ranks that caused this timeout. They never joined any"
        " collectives\n"
    )
    logs = {
        r: nccl_timeout_rank(r).replace("before timing out.\n", "before timing out." + report, 1) for r in (0, 1, 3)
    }
    logs[2] = "step 2050 loss 2.3120\n"
    d = diagnose_ranks(logs)
    assert d.first_rank == 2 and d.basis == "named" and d.suspects == [2]
    assert d.root is not None and d.root.kind == "desync" and d.root.rank == 0
    assert d.summary().startswith("Rank 2 failed first: desync report: ranks [2] never joined the collective (reported")
    assert all(not f.primary for f in d.findings if f is not d.root)


def test_monitored_barrier_names_the_missing_rank() -> None:
    r0 = classify(MONITORED_BARRIER_RANK0, rank=0)
    assert kinds(r0) == ["monitored_barrier", "gloo_timeout"]
    assert r0[0].suspects == (1,) and r0[0].title == "rank 1 did not reach the monitored barrier within 3000 ms"
    d = diagnose_ranks({0: MONITORED_BARRIER_RANK0, 1: ""}, exit_codes={0: 1, 1: -15})
    # rank 1 was SIGTERMed by torchrun after rank 0 failed: its exit is a consequence, the barrier report is not
    assert d.first_rank == 1 and d.basis == "named" and d.root is not None and d.root.kind == "monitored_barrier"
    assert [f.kind for f in d.by_rank[1]] == ["terminated"]


def test_named_rank_without_a_log() -> None:
    d = diagnose_ranks({0: MONITORED_BARRIER_RANK0.replace("Rank 1 failed", "Rank 5 failed")})
    assert d.first_rank == 5 and d.basis == "named" and d.root is not None and d.root.rank == 0
    assert d.summary().startswith("Rank 5 failed first: rank 5 did not reach the monitored barrier within 3000 ms")


def test_gloo_timeout_with_a_silent_rank() -> None:
    d = diagnose_ranks({0: GLOO_TIMEOUT_RANK0, 1: ""})
    assert d.root is not None and d.root.kind == "gloo_timeout" and d.root.data == {"op": "recv", "timeout_ms": 5000}
    assert d.first_rank == 0 and d.basis == "timeout" and d.silent_ranks == [1]
    assert "Rank 1 left no error" in d.summary()
    # with the exit codes the silent rank is explained: a segfault
    d = diagnose_ranks({0: GLOO_TIMEOUT_RANK0, 1: ""}, exit_codes={0: 1, 1: -11})
    assert d.first_rank == 1 and d.root is not None and d.root.kind == "silent_exit"
    assert d.root.title == "crashed with a segmentation fault (SIGSEGV)"
    assert not next(f for f in d.findings if f.kind == "gloo_timeout").primary


def test_collective_mismatch_real_format() -> None:
    d = diagnose_ranks(MISMATCH)
    assert d.first_rank == 0 and d.root is not None and d.root.kind == "collective_mismatch"
    assert (
        d.root.title
        == "ranks called different collectives: rank 0 ALLREDUCE vs rank 1 BROADCAST (Op type: ALLREDUCE vs BROADCAST)"
    )
    assert "Rank 1 also reports collective mismatch." in d.summary()


def test_shm_too_small_under_the_nccl_error() -> None:
    logs = {0: SHM_RANK, **{r: DIST_BACKEND_REMOTE.format(r=r) for r in (1, 2, 3)}}
    r0 = classify(SHM_RANK)
    # the generic "unhandled system error" is explained by the WARN line and not reported on its own
    assert kinds(r0) == ["shm_too_small"]
    assert r0[0].data == {"size": 9637892} and len(r0[0].evidence) == 3
    d = diagnose_ranks(logs)
    assert d.first_rank == 0 and d.root is not None and d.root.kind == "shm_too_small"
    assert "--shm-size" in d.root.fix and "--ipc=host" in d.root.fix and "NCCL_SHM_DISABLE=1" in d.root.fix
    assert [f.kind for f in d.findings[1:]] == ["peer_closed"] * 3
    assert "(peer closed ×3) are consequences" in d.summary()
    assert d.facts[0].bootstrap == "eth0:172.17.0.2<0>" and d.facts[0].nnodes == 1


@pytest.mark.parametrize("variant", sorted(IB_WARNS))
def test_ib_retry_exceeded_formats(variant: str) -> None:
    rank5 = nccl_init("node-a", 5776, 5, 5) + IB_WARNS[variant] + "\n" + DIST_BACKEND_REMOTE.format(r=5)
    fs = classify(rank5, rank=5)
    assert kinds(fs) == ["ib_retry_exceeded", "peer_closed"]
    assert fs[0].data["status"] == 12 and fs[0].data["status_name"] == "IBV_WC_RETRY_EXC_ERR"
    assert "NCCL_IB_TIMEOUT" in fs[0].fix and "NCCL_IB_RETRY_CNT" in fs[0].fix
    logs = {r: nccl_init("node-b", 900 + r, r - 8, r) + DIST_BACKEND_REMOTE.format(r=r) for r in range(8, 16)}
    d = diagnose_ranks({5: rank5, **logs})
    assert d.first_rank == 5 and d.root is not None and d.root.kind == "ib_retry_exceeded"
    assert "(peer closed ×8) are consequences" in d.summary()


def test_ib_status_variants() -> None:
    flush = "h:1:2 [0] transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with error 5, opcode 0, len 0, vendor err 249 (Recv)"
    prot = "h:1:2 [0] transport/net_ib.cc:2453 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=4 opcode=0 len=0 vendor err 81 (Send) hca mlx5_0"
    assert [(f.kind, f.primary) for f in classify(flush)] == [("peer_closed", False)]
    (f,) = classify(prot)
    assert f.kind == "ib_completion_error" and "IBV_WC_LOC_PROT_ERR" in f.title and "nvidia-peermem" in f.fix
    assert f.data["hca"] == "mlx5_0"


@pytest.mark.parametrize(
    ("log", "kind", "fix_has"),
    [
        (IFNAME_RANK, "socket_ifname", "NCCL_SOCKET_IFNAME"),
        ("RuntimeError: [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/device.cc:83] ifa != nullptr. Unable to find address for: eth1\n",
         "socket_ifname", "GLOO_SOCKET_IFNAME"),
        ("node-a:1:1 [0] misc/ibvwrap.cc:153 NCCL WARN Call to ibv_reg_mr failed with error Bad address\n",
         "registration_failure", "memlock"),
        ("node-a:1:1 [0] misc/ibvwrap.cc:98 NCCL WARN Call to ibv_create_qp failed\n", "registration_failure", "ulimit -l"),
        ("node-b:2:2 [0] init.cc:612 NCCL WARN Mismatched NCCL version detected : rank 1 version 22105 rank 0 version 21903\n",
         "nccl_version_mismatch", "same torch build"),
        (PORT_IN_USE, "port_in_use", "--master-port"),
        ("RuntimeError: The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use).\n",
         "port_in_use", "ss -ltnp"),
        (STORE_CLIENT_TIMEOUT, "store_unreachable", "MASTER_ADDR"),
        (STORE_SERVER_TIMEOUT, "rendezvous_timeout", "--nnodes"),
        ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n", "rendezvous_timeout", "join_timeout"),
        ("node-a:1:9 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 172.17.0.3<45111> failed : No route to host\n",
         "socket_connect", "NCCL_SOCKET_IFNAME"),
        ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was encountered'\n",
         "cuda_error", "CUDA_LAUNCH_BLOCKING=1"),
        ("node-a:1:1 [0] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'\n", "cuda_oom", "NCCL_BUFFSIZE"),
        ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit.\n",
         "shm_too_small", "--shm-size"),
        ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).\n",
         "shm_too_small", "--ipc=host"),
        ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.\n", "host_oom", "OOM killer"),
        ("[rank0]:[E1122 10:49:02.1 ProcessGroupNCCL.cpp:1401] [PG ID 0 PG GUID 0(default_pg) Rank 0] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued collectives.\n",
         "watchdog_hang", "xid"),
        ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5\n",
         "nccl_error", "NCCL_DEBUG=INFO"),
    ],
)  # fmt: skip
def test_single_failure_kinds(log: str, kind: str, fix_has: str) -> None:
    fs = [f for f in classify(log) if f.severity == "error"]
    assert fs and fs[0].kind == kind, [(f.kind, f.title) for f in fs]
    assert fix_has in fs[0].fix
    assert fs[0].primary and fs[0].evidence
    assert kind in KINDS


def test_titles_carry_the_message_details() -> None:
    (v,) = classify(
        "h:2:2 [0] init.cc:612 NCCL WARN Mismatched NCCL version detected : rank 1 version 22105 rank 0 version 21903"
    )
    assert v.title == "NCCL version mismatch: rank 1 has 2.21.5, rank 0 has 2.19.3"
    (p,) = classify(PORT_IN_USE)
    assert p.data == {"port": 29517}
    (s,) = classify(STORE_CLIENT_TIMEOUT)
    assert s.title == "cannot reach the TCPStore at 10.0.0.1:29534"
    (j,) = classify(STORE_SERVER_TIMEOUT)
    assert j.title == "only 1/2 ranks joined within 5 s"


def test_nccl_bind_chatter_and_gloo_loopback_are_not_failures() -> None:
    # NCCL retries another port after this WARN: not a port conflict
    assert classify("h:1:1 [0] misc/socket.cc:473 NCCL WARN Call to bind failed: Address already in use\n") == []
    (w,) = classify(
        "[W1122 06:29:01.1 ProcessGroupGloo.cpp:514] Warning: Unable to resolve hostname to a (local) address. "
        "Using the loopback address as fallback. Manually set the network interface to bind to with "
        "GLOO_SOCKET_IFNAME. (function operator())\n"
    )
    assert w.kind == "gloo_loopback" and w.severity == "warning"
    assert diagnose_ranks({0: w.evidence[0]}).first_rank is None


def test_exit_times_pick_the_first_failure() -> None:
    logs = {r: DIST_BACKEND_REMOTE.format(r=r) for r in range(4)}
    logs[2] = "step 10\n"
    d = diagnose_ranks(logs, {0: 12.5, 1: 12.4, 2: 3.0, 3: 12.6}, exit_codes={0: 1, 1: 1, 2: -9, 3: 1})
    assert d.first_rank == 2 and d.basis == "signal"  # its signal names it, whatever the times
    assert d.root is not None and d.root.kind == "host_oom" and "dmesg" in d.root.fix
    assert "(peer closed ×3) are consequences" in d.summary()
    # exit times alone (no codes): the earliest of the ranks that show an error
    d = diagnose_ranks(logs, {0: 12.5, 1: 12.4, 2: 3.0, 3: 12.6})
    assert d.first_rank == 1 and d.basis == "exit_time" and d.silent_ranks == [2]


def test_combined_stream_keeps_ranks_apart() -> None:
    stream = OOM_RANK + nccl_timeout_rank(0) + nccl_timeout_rank(1)
    fs = classify(stream)
    assert {(f.kind, f.rank) for f in fs} == {("cuda_oom", 3), ("nccl_timeout", 0), ("nccl_timeout", 1)}
    assert sorted(split_by_rank(stream)) == [0, 1, 3]


def test_to_dict_is_json() -> None:
    d = diagnose_ranks({0: SHM_RANK, 1: DIST_BACKEND_REMOTE.format(r=1)})
    out = json.loads(json.dumps(d.to_dict()))
    assert out["first_rank"] == 0 and out["root"]["kind"] == "shm_too_small"
    assert out["ranks"]["0"]["facts"]["version"] == "2.21.5+cuda12.4"
    assert out["summary"].startswith("Rank 0 failed first: cannot create a shared-memory segment of 9.2 MiB")


# -------------------------------------------------------------------------------------- real gloo failure
FAILING_SCRIPT = """\
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=5))
if dist.get_rank() == 1:
    raise ValueError("rank 1 failed before the collective")
dist.all_reduce(torch.ones(4))  # rank 0 waits here for rank 1
"""


@pytest.mark.slow
def test_real_gloo_failure_names_rank_1(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script, log_dir = tmp_path / "fail.py", tmp_path / "logs"
    script.write_text(FAILING_SCRIPT)
    # --monitor-interval 1: the agent waits a moment before SIGTERMing rank 0, so rank 0 gets to log its error
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "1", "--redirects", "3", "--log-dir", str(log_dir), str(script)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_", "TORCH_DISTRIBUTED"))}
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        agent_out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        agent_out, _ = proc.communicate()
        pytest.fail(f"torchrun did not exit within 60 s\n{agent_out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the session is left
        except ProcessLookupError:
            pass
    assert proc.returncode != 0, agent_out[-3000:]
    logs = {}
    for r in (0, 1):
        (path,) = log_dir.glob(f"*/attempt_0/{r}/stderr.log")
        logs[r] = path.read_text()
    assert "ValueError: rank 1 failed before the collective" in logs[1], logs
    d = diagnose_ranks(logs, exit_codes=parse_child_failures(agent_out))
    assert d.first_rank == 1, d.summary()
    assert d.root is not None and d.root.kind == "rank_exception" and d.root.rank == 1
    assert d.root.title == "ValueError: rank 1 failed before the collective"
    rank0 = [f for f in d.by_rank[0] if f.severity == "error"]
    assert rank0, (logs[0], agent_out[-3000:])
    # rank 0 learns of it as "Connection closed by peer" (rank 1's sockets closed) or, if slower, as a timeout
    assert rank0[0].kind in ("peer_closed", "gloo_timeout", "terminated") and not rank0[0].primary, rank0
    assert d.findings[0] is d.root
    assert d.summary().startswith("Rank 1 failed first: ValueError: rank 1 failed before the collective.")
    assert "are consequences" in d.summary()


# ---- issue 29: a rank a signal ended is the cause ------------------------------------------------------------

TORCHRUN_TABLE = """\
Failures:
[1]:
  time      : 2026-11-27_04:30:53
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 23191)  (SIGTERM)
  error_file: <N/A>
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_04:30:53
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 23192)  (SIGKILL)
  error_file: <N/A>
"""


def test_a_rank_killed_by_a_signal_is_the_first_rank_even_when_a_peer_exited_earlier() -> None:
    from jupyter_dist.telemetry.diagnose import diagnose_ranks

    logs = {0: "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5", 1: ""}
    plain = diagnose_ranks(logs, {0: 10.0}, exit_codes={0: 1})
    assert plain.first_rank == 0  # without the killed rank's code, rank 0 looks first
    note = "rank 1 was killed by SIGKILL — the kernel's out-of-memory killer sends this; its peak RSS was 300 MiB"
    d = diagnose_ranks(logs, {0: 10.0}, exit_codes={0: 1, 1: -9}, exit_notes={1: note})
    assert (d.first_rank, d.basis, d.root.kind) == (1, "signal", "host_oom"), d.summary()
    assert d.summary().startswith("Rank 1 failed first: killed by SIGKILL — the kernel's out-of-memory killer"), d
    assert "peak RSS was 300 MiB" in d.summary() and "consequences" in d.summary()
    # SIGTERM is how a launcher stops ranks: never the cause
    assert diagnose_ranks(logs, {0: 10.0}, exit_codes={0: 1, 1: -15}).first_rank == 0


def test_torchrun_table_and_the_oom_verdict(tmp_path: Path) -> None:
    from jupyter_dist.launch.exits import culprit, killed_report, rank_exits
    from jupyter_dist.launch.rundir import RunDir

    rd = RunDir(tmp_path).create()
    (rd.logs / "launcher.log").write_text(TORCHRUN_TABLE)
    rd.exit_file(0).write_text('{"rank": 0, "code": 1, "error": "RuntimeError: x", "t": 5.0}')
    exits = rank_exits(rd, 2)
    assert (exits[0].code, exits[0].source) == (1, "exit file")  # its own file wins over torchrun's -15
    assert (exits[1].code, exits[1].source, exits[1].pid) == (-9, "torchrun", 23192)
    ex = culprit(exits)
    assert ex is not None and ex.rank == 1 and ex.signal_name == "SIGKILL"
    mib = 2**20
    sure = killed_report(ex, peak=512 * mib, oom_before=0, oom_after=1, kernel_line=None)
    assert sure["oom"] is True and sure["reason"].startswith(
        "rank 1 was killed by SIGKILL — the kernel's out-of-memory killer sends this; its peak RSS was 512 MiB; "
        "the cgroup counted 1 OOM kill(s)"), sure
    other = killed_report(ex, peak=None, oom_before=3, oom_after=3, kernel_line=None)
    assert other["oom"] is False and "no OOM kill" in other["reason"]
    unknown = killed_report(ex, peak=None, oom_before=None, oom_after=None, kernel_line=None)
    assert unknown["oom"] is None and unknown["reason"].endswith("sends this")
    log = killed_report(ex, peak=None, oom_before=None, oom_after=None,
                        kernel_line="Out of memory: Killed process 23192 (python)")  # fmt: skip
    assert log["oom"] is True and "kernel log confirms" in log["reason"]
    assert culprit({0: exits[0]}) is None

