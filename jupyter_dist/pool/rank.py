"""The loop each rank of an interactive pool runs (``%dist_start``): receive cells from the kernel, execute, answer.

Started by torchrun through the same bootstrap as ``%%dist_train`` (stdout/stderr to ``logs/rank-<k>.log``,
faulthandler on SIGUSR1), with ``jd`` bound and the process group initialised. The rank connects back to the kernel
over the authenticated channel (:mod:`jupyter_dist.pool.channel`), address and key from ``JD_POOL_ADDR`` /
``JD_POOL_KEY`` (removed from the environment once read, so cells and their child processes do not see the key).

One namespace per rank lives from cell to cell. While a cell runs its ``sys.stdout``/``sys.stderr`` stream back to
the kernel (and still go to the rank's log). SIGINT raises ``KeyboardInterrupt`` only while a cell executes; at any
other moment it is ignored, so an interrupt never ends the rank. The rank exits when the kernel says ``shutdown``,
when the connection closes, when a frame with a bad signature arrives (logged), or when the kernel process is gone.
"""

from __future__ import annotations

import ast
import builtins
import copy
import linecache
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from .channel import NONCE_SIZE, AuthError, Channel, ChannelClosed, recv_exact

__all__ = ["serve", "to_transfer"]

_log = logging.getLogger("jupyter_dist.pool")
_MAX_REPR = 20_000


class _Executing:
    """Whether the main thread is inside a cell (the SIGINT handler raises only then), or sending a frame."""

    active = False
    sending = False
    pending = False


def _on_sigint(signum: int, frame: Any) -> None:
    if _Executing.active and _Executing.sending:  # never break a frame half-way: raise once it is sent
        _Executing.pending = True
        return
    if _Executing.active:
        raise KeyboardInterrupt
    print("jupyter-dist pool: SIGINT outside a cell ignored", file=sys.__stderr__, flush=True)


class _RankStream:
    """``sys.stdout``/``sys.stderr`` during a cell: text goes to the kernel (and to the rank's log).

    Text is buffered and sent by the rank's flusher thread every 50 ms (so a burst of prints is a few frames, not one
    per line), inline by the writer when more than 64 KiB wait, and at the end of the cell.
    """

    def __init__(self, channel: Channel, request: int, name: str, tee: Any) -> None:
        self._channel = channel
        self._request = request
        self.name = name
        self._tee = tee
        self._buf: list[str] = []
        self._size = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # swap and send together: chunks leave in the order they were written
        self.encoding = "utf-8"
        self.errors = "replace"

    @property
    def waiting(self) -> bool:
        """Whether buffered text waits to be sent."""
        return self._size > 0

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self._tee is not None:
            try:
                self._tee.write(text)
            except Exception:  # the log must never break the cell
                pass
        with self._lock:
            self._buf.append(text)
            self._size += len(text)
            big = self._size > 65536
        if big:
            self.flush()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        if main:
            _Executing.sending = True
        try:
            with self._send_lock:
                with self._lock:
                    text, self._buf, self._size = "".join(self._buf), [], 0
                if self._tee is not None:
                    try:
                        self._tee.flush()
                    except Exception:
                        pass
                if text:
                    try:
                        self._channel.send({"op": "stream", "id": self._request, "name": self.name, "text": text})
                    except ChannelClosed:
                        pass
        finally:
            if main:
                _Executing.sending = False
        if main and _Executing.pending and _Executing.active:
            _Executing.pending = False
            raise KeyboardInterrupt

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1 if self.name == "stdout" else 2

    @property
    def closed(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        return None
    return DTensor


def _plain(t: Any) -> Any:
    """A tensor as a detached CPU tensor that pickles only its own elements (a view would ship its whole base)."""
    out = t.detach()
    if out.device.type != "cpu":
        out = out.cpu()
    elif out.untyped_storage().nbytes() > out.numel() * out.element_size() or not out.is_contiguous():
        out = out.clone()
    if t.requires_grad and t.is_leaf:
        out.requires_grad_(True)
    return out


def to_transfer(obj: Any, *, gather: bool = False) -> Any:
    """What :func:`%dist_pull` sends for ``obj``: tensors as CPU tensors, a DTensor as its local shard or gathered.

    Containers (dict, list, tuple) are converted item by item; modules come back on the CPU (a copy when they live
    on an accelerator; the rank's module is not moved). ``gather=True`` calls ``DTensor.full_tensor()``, a collective:
    every rank must convert the same object.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        return _plain(obj.full_tensor() if gather else obj.to_local())
    if isinstance(obj, torch.Tensor):
        return _plain(obj)
    if isinstance(obj, torch.nn.Module):
        tensors = list(obj.parameters()) + list(obj.buffers())
        if dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
            raise TypeError(
                "this module's parameters are DTensors (FSDP2/TP): in a cell take sd = model.state_dict(), then "
                "%dist_pull sd (each rank's shards) or %dist_pull sd --gather (full tensors)"
            )
        if all(t.device.type == "cpu" for t in tensors):
            return obj
        return copy.deepcopy(obj).cpu()
    if type(obj) in (dict, list, tuple) or isinstance(obj, dict):
        if isinstance(obj, dict):
            items = {k: to_transfer(v, gather=gather) for k, v in obj.items()}
            try:
                out = copy.copy(obj)
                out.clear()
                out.update(items)
                return out
            except Exception:
                return items
        converted = [to_transfer(v, gather=gather) for v in obj]
        return type(obj)(converted)
    return obj


def _cell_frames(tb: Any, prefix: str) -> Any:
    """Skip this module's frames: the traceback starts at the first frame of a pool cell."""
    first = tb
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(prefix):
            return tb
        tb = tb.tb_next
    return first


def _format_error(exc: BaseException) -> dict[str, Any]:
    tb = _cell_frames(exc.__traceback__, "<dist-cell-")
    text = "".join(traceback.format_exception(type(exc), exc, tb, limit=-50))
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": text}


class _Rank:
    def __init__(self, channel: Channel, rank: int) -> None:
        self.channel = channel
        self.rank = rank
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        jd = sys.modules.get("jupyter_dist.worker")
        if jd is not None:
            self.ns["jd"] = jd
        self.streams: list[_RankStream] = []
        threading.Thread(target=self._flusher, name="jd-pool-flusher", daemon=True).start()

    def _flusher(self) -> None:
        """Send the cell's buffered output every 50 ms."""
        while True:
            time.sleep(0.05)
            for stream in list(self.streams):
                if stream.waiting:
                    stream.flush()

    # ---------------------------------------------------------------- ops
    def run(self) -> None:
        while True:
            try:
                header, blob = self.channel.recv()
            except AuthError as exc:
                _log.error("jupyter-dist pool rank %d: refused a message from the kernel: %s", self.rank, exc)
                print(f"jupyter-dist pool: rank {self.rank} refused a message: {exc}; closing the connection",
                      file=sys.__stderr__, flush=True)  # fmt: skip
                return
            except ChannelClosed:
                return
            op = header.get("op")
            request = int(header.get("id", 0))
            if op == "shutdown":
                self.channel.send({"op": "done", "id": request, "ok": True})
                return
            handler = {"exec": self.op_exec, "push": self.op_push, "pull": self.op_pull, "ping": self.op_ping}.get(
                str(op)
            )
            if handler is None:
                error = {"ename": "ValueError", "evalue": f"unknown op {op!r}", "traceback": ""}
                self.channel.send({"op": "done", "id": request, "ok": False, "error": error})
                continue
            reply, out_blob = handler(header, blob)
            try:
                self.channel.send({"op": "done", "id": request, **reply}, out_blob)
            except ChannelClosed:
                return

    def op_ping(self, header: dict[str, Any], blob: Any) -> tuple[dict[str, Any], bytes]:
        return {"ok": True, "pid": os.getpid()}, b""

    def op_exec(self, header: dict[str, Any], blob: Any) -> tuple[dict[str, Any], bytes]:
        request = int(header["id"])
        name = str(header.get("name") or f"<dist-cell-{request}>")
        code = str(header.get("code", ""))
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        out = _RankStream(self.channel, request, "stdout", sys.stdout)
        err = _RankStream(self.channel, request, "stderr", sys.stderr)
        saved = sys.stdout, sys.stderr
        self.streams = [out, err]
        reply: dict[str, Any] = {"ok": True}
        t0 = time.monotonic()
        sys.stdout, sys.stderr = out, err
        try:
            try:
                tree = ast.parse(code, filename=name)
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body[-1].value)
                    tree.body.pop()
                body = compile(tree, name, "exec")
                tail = compile(last, name, "eval") if last is not None else None
                _Executing.pending = False
                _Executing.active = True
                try:
                    exec(body, self.ns)
                    value = eval(tail, self.ns) if tail is not None else None
                finally:
                    _Executing.active = False
                if value is not None:
                    text = repr(value)
                    reply["value"] = text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + " ..."
                    self.ns["_"] = value
            except BaseException as exc:  # noqa: BLE001 - the cell's failure, whatever it is, is reported
                _Executing.active = False
                reply = {"ok": False, "interrupted": isinstance(exc, KeyboardInterrupt), "error": _format_error(exc)}
                if not isinstance(exc, KeyboardInterrupt):
                    print(reply["error"]["traceback"], end="", file=saved[1], flush=True)  # into the rank's log
        finally:
            _Executing.active = False
            sys.stdout, sys.stderr = saved
            self.streams = []
            out.flush()
            err.flush()
        reply["elapsed"] = time.monotonic() - t0
        _flush_telemetry()
        return reply, b""

    def op_push(self, header: dict[str, Any], blob: Any) -> tuple[dict[str, Any], bytes]:
        import cloudpickle

        try:
            objects = cloudpickle.loads(blob)
            self.ns.update(objects)
        except Exception as exc:
            return {"ok": False, "error": _format_error(exc)}, b""
        return {"ok": True, "names": sorted(objects)}, b""

    def op_pull(self, header: dict[str, Any], blob: Any) -> tuple[dict[str, Any], bytes]:
        import cloudpickle

        name = str(header["name"])
        send = bool(header.get("send", True))
        if name not in self.ns:
            err = {"ename": "NameError", "evalue": f"name {name!r} is not defined on rank {self.rank}",
                   "traceback": ""}  # fmt: skip
            return {"ok": False, "error": err}, b""
        try:
            value = to_transfer(self.ns[name], gather=bool(header.get("gather")))
            if not send:
                return {"ok": True}, b""
            payload = cloudpickle.dumps(value, protocol=5)
        except Exception as exc:
            return {"ok": False, "error": {**_format_error(exc), "traceback": ""}}, b""
        return {"ok": True, "type": type(value).__name__}, payload


def _flush_telemetry() -> None:
    """Write the buffered ``jd.log`` calls of the cell now, so the panels show them when the cell ends."""
    try:
        from ..worker._runtime import get_runtime

        emitter = get_runtime()._emitter
        if emitter is not None:
            emitter.flush()
    except Exception:  # telemetry never breaks the pool
        pass


def _watch_kernel(pid: int) -> None:
    """End this rank when the kernel process is gone (e.g. killed), so no rank outlives its notebook."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"jupyter-dist pool: the kernel (pid {pid}) is gone; this rank exits", file=sys.__stderr__,
                  flush=True)  # fmt: skip
            os._exit(1)
        except PermissionError:
            pass


def serve() -> None:
    """Connect to the kernel, then execute what it sends until it says shutdown or goes away."""
    addr = os.environ.pop("JD_POOL_ADDR", "")
    key_hex = os.environ.pop("JD_POOL_KEY", "")
    kernel_pid = int(os.environ.pop("JD_POOL_KERNEL_PID", "0") or 0)
    if not addr or not key_hex:
        raise SystemExit("jupyter-dist pool: JD_POOL_ADDR and JD_POOL_KEY must be set (start pools with %dist_start)")
    key = bytes.fromhex(key_hex)
    import jupyter_dist.worker as jd

    jd.init()  # the process group (gloo on CPU, nccl with CUDA) and the start record
    rank = jd.rank
    if kernel_pid:
        threading.Thread(target=_watch_kernel, args=(kernel_pid,), name="jd-pool-kernel-watch", daemon=True).start()
    host, _, port = addr.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = bytes(recv_exact(sock, NONCE_SIZE))
    sock.settimeout(None)
    channel = Channel(sock, key, nonce, kernel_side=False)
    channel.send({"op": "hello", "rank": rank, "pid": os.getpid(), "world_size": jd.world_size,
                  "local_rank": jd.local_rank, "host": socket.gethostname()})  # fmt: skip
    try:
        header, _ = channel.recv()
    except AuthError as exc:
        print(f"jupyter-dist pool: rank {rank} refused the kernel's welcome: {exc}", file=sys.__stderr__, flush=True)
        raise SystemExit(3) from None
    if header.get("op") != "welcome":
        raise SystemExit(f"jupyter-dist pool: expected welcome, got {header.get('op')!r}")
    signal.signal(signal.SIGINT, _on_sigint)
    print(f"jupyter-dist pool: rank {rank} connected to the kernel at {addr}", flush=True)
    try:
        _Rank(channel, rank).run()
    finally:
        channel.close()
