"""The interactive pool: N ranks that stay alive, each keeping its namespace from cell to cell (``%dist_start``).

The ranks are started by the same local torchrun launcher as ``%%dist_train`` (fresh processes, process group
initialised, ``jd`` bound; see :mod:`jupyter_dist.pool.rank` for their loop) and connect back to the kernel over
the authenticated channel of :mod:`jupyter_dist.pool.channel`, which listens on 127.0.0.1 only. The pool's key is
random, lives in the kernel's memory and in the ranks' environment at start-up (they remove it once read), and is
never written to a file.

A :class:`Pool` executes code on all or some ranks (:meth:`Pool.execute`), moves objects between the notebook and
the ranks (:meth:`Pool.push`, :meth:`Pool.pull`), interrupts (SIGINT to the ranks, caught around the cell only),
diagnoses a cell that runs past its timeout (faulthandler stacks through SIGUSR1, as the hang diagnosis of a run
does) and notices a rank that dies (the pool is then *broken* and says which rank and why). The pool's run directory
is an ordinary one (``run.json`` with ``"kind": "pool"``, ``logs/``, ``telemetry/``), so ``jd.log`` in a cell feeds
the same live panels (:meth:`Pool.dashboard`) and ``logs/pool.log`` records what the control channel did.

The values it returns and the errors it raises (``RankReport``, ``CellResult``, ``CellError``, ``PoolError``...) are in
:mod:`.results`. What is left here is one piece on purpose: :class:`Pool` is a state machine over one set of
connections (handshake, per-rank reader threads, waits that forward interrupts and diagnose hangs, stop), and its
per-connection bookkeeping (``_Conn``, ``_Reply``, ``_Wait``, ``_InterruptFlag``) has no other user.
"""

from __future__ import annotations

import atexit
import contextlib
import html
import logging
import os
import queue
import re
import signal
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from .._atomic import write_atomic
from ..launch.backends.local import LocalLauncher
from ..launch.record import RunRecord, kernel_versions
from ..launch.run import STOPPED, Run, kill_tree
from ..launch.rundir import new_run_dir, scrub_env
from ..launch.session import start_recorded
from .channel import MAX_UNAUTHENTICATED, NONCE_SIZE, AuthError, Channel, ChannelClosed, new_key
from .results import CellError, CellResult, PoolBroken, PoolError, PoolInterrupted, RankReport, parse_ranks

__all__ = ["CellError", "CellResult", "Pool", "PoolBroken", "PoolError", "PoolInterrupted", "RankReport",
           "parse_ranks", "start_pool"]  # fmt: skip

_log = logging.getLogger("jupyter_dist.pool")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to deliver its whole signed hello."""
MAX_PENDING_HANDSHAKES = 32
"""Connections waiting for their hello at once; more are refused at once (a flood gets no thread each)."""
MAX_REFUSED_KEPT = 100
"""Refusals kept in :attr:`Pool.refused` and logged one by one (then every 1000th)."""


def _shutdown(sock: socket.socket, expired: threading.Event) -> None:
    expired.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
_LIVE: weakref.WeakSet[Pool] = weakref.WeakSet()

POOL_SCRIPT = "from jupyter_dist.pool.rank import serve\n\nserve()\n"
"""The program of every rank (after the ``jd`` prelude of ``%%dist_train`` scripts)."""

INTERRUPT_GRACE_S = 10.0
"""Seconds the ranks get to end an interrupted cell before the pool is declared broken."""

_CELL_RE = re.compile(r'File "(<dist-cell-\d+>)", line (\d+)')
_THREAD_RE = re.compile(r"(?:Current thread|Thread) 0x[0-9a-fA-F]+ [^\n]*\(most recent call first\):")
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


class _InterruptFlag:
    """While waiting on the ranks, SIGINT (a kernel interrupt) only counts; the wait loop forwards it to the ranks.

    Installed only in the main thread (where Python delivers signals); elsewhere ``KeyboardInterrupt`` is caught.
    """

    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __enter__(self) -> _InterruptFlag:
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(signal.SIGINT, self._handler)
                self._installed = True
            except (ValueError, OSError):
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


@dataclass
class _Conn:
    rank: int
    pid: int
    channel: Channel
    peer: str
    thread: threading.Thread | None = None


@dataclass
class _Reply:
    header: dict[str, Any]
    blob: Any = b""


@dataclass
class _Wait:
    replies: dict[int, _Reply] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    interrupted: bool = False
    timed_out: bool = False
    where: dict[int, str] = field(default_factory=dict)
    stuck: list[int] = field(default_factory=list)


class Pool:
    """A pool of ranks that keep their state across cells. Build it, then :meth:`start` (or use :func:`start_pool`).

    Parameters
    ----------
    nproc
        Number of ranks (processes on this machine).
    strategy
        What ``jd.wrap`` applies in the ranks (as for ``%%dist_train``; ``auto``: the plan's choice, else DDP).
    plan
        A :class:`~jupyter_dist.plan.Plan` (strategy, precision, DeepSpeed config).
    name
        Prefix of the run directory.
    env
        Extra environment for the ranks.
    runs_dir
        Where the run directory goes.
    start_timeout
        Seconds to wait for every rank to connect.
    interrupt_grace
        Seconds the ranks get to end an interrupted cell before the pool is declared broken.
    """

    def __init__(self, *, nproc: int = 2, strategy: str = "auto", plan: Any = None, name: str = "pool",
                 env: dict[str, str] | None = None, runs_dir: str | os.PathLike[str] = "runs",
                 start_timeout: float = 120.0, interrupt_grace: float = INTERRUPT_GRACE_S,
                 oversubscribe: bool = False) -> None:  # fmt: skip
        from ..launch.backends.local import check_user_env
        from ..launch.session import launch_contract

        if nproc < 1:
            raise PoolError(f"--nproc must be >= 1, got {nproc}")
        if not start_timeout > 0:
            raise PoolError(f"the start timeout must be positive seconds, got {start_timeout}")
        if plan is not None and not hasattr(plan, "best"):
            raise PoolError(f"--plan must name a Plan object, got a {type(plan).__name__}")
        for key in env or {}:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise PoolError(f"--env name {key!r} is not a valid environment variable name")
        check_user_env(dict(env or {}))  # RANK, MASTER_PORT, ...: the launcher's
        self.oversubscribe = oversubscribe
        """Start more ranks than the machine holds (see :func:`~jupyter_dist.launch.backends.local.check_capacity`)."""
        self.nproc = nproc
        self.world_size = nproc
        self.choice, self._contract = launch_contract(strategy, plan, nproc=nproc)
        self.strategy = self.choice.strategy
        """The base strategy the ranks apply (the candidate with its degrees: ``choice.candidate.name``)."""
        self.plan = plan
        self.name = name
        self._env = dict(env or {})
        self._runs_dir = runs_dir
        self._start_timeout = start_timeout
        self.interrupt_grace = interrupt_grace
        self._key = new_key()
        self.state = "before"
        """``before``, ``starting``, ``ready``, ``busy``, ``broken`` or ``stopped``."""
        self.reason: str | None = None
        """Why the pool is broken."""
        self.run: Run | None = None
        """The :class:`~jupyter_dist.launch.run.Run` of the torchrun job behind the pool (logs, status, panels)."""
        self.dir: Path | None = None
        self.last: CellResult | None = None
        """The last cell's result."""
        self.refused: deque[dict[str, Any]] = deque(maxlen=MAX_REFUSED_KEPT)
        """The latest connections the control channel refused: ``{"t", "peer", "reason"}`` (bounded)."""
        self.refused_total = 0
        """How many connections were refused in all."""
        self._handshakes = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self.cells = 0
        """Cells executed."""
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.RLock()
        self._busy = threading.Lock()
        self._flag: _InterruptFlag | None = None
        self._queue: queue.Queue[tuple[int, dict[str, Any], Any]] = queue.Queue()
        self._all_connected = threading.Event()
        self._closing = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._request = 0
        self._sources: dict[str, str] = {}
        self._lost: dict[int, str] = {}
        self._stray: deque[tuple[int, str, str]] = deque(maxlen=1000)
        self.address: str | None = None
        """``127.0.0.1:<port>`` of the control channel."""

    # ---------------------------------------------------------------- start
    def _jd_env(self) -> dict[str, str]:
        from ..launch.session import local_cpu_plan

        contract = self._contract
        if self.strategy.startswith("zero"):
            from ..render.common import RenderOptions
            from ..render.deepspeed import render_deepspeed_json

            ds_plan = self.plan if self.plan is not None else local_cpu_plan(self.strategy, self.nproc, 1)
            assert self.dir is not None
            write_atomic(self.dir / "ds_config.json", render_deepspeed_json(ds_plan, RenderOptions(
                candidate=self.strategy)))  # fmt: skip
            contract = replace(contract, ds_config=str(self.dir / "ds_config.json"))
        return {**contract.to_environ(), "JD_POOL": "1", **self._env}

    def dry_run(self) -> Any:
        """What :meth:`start` would run (command, environment, script), started nothing and written nothing."""
        from ..launch.rundir import RunDir
        from ..launch.session import PRELUDE, DryRun

        rd = RunDir(Path(self._runs_dir).expanduser().resolve() / f"{self.name}-DRYRUN")
        env = {**self._contract.to_environ(), "JD_POOL": "1", **self._env,
               "JD_POOL_ADDR": "127.0.0.1:<port chosen at start>", "JD_POOL_KEY": "<random per pool, never written>",
               "JD_POOL_KERNEL_PID": str(os.getpid())}  # fmt: skip
        lau = LocalLauncher(run_dir=rd, nproc=self.nproc, extra_env=env)
        return DryRun(script=PRELUDE + POOL_SCRIPT, argv=lau.args(), env=lau.env())

    def start(self) -> Pool:
        """Start the ranks and wait until every one has connected (at most ``start_timeout`` s)."""
        from ..launch.backends.local import check_capacity
        from ..launch.session import PRELUDE, local_gpu_count

        if self.state != "before":
            raise PoolError(f"this pool is {self.state}; build a new Pool to start again")
        check_capacity(self.nproc, 1, gpus=local_gpu_count(), oversubscribe=self.oversubscribe)  # before any write
        self.state = "starting"
        rd = new_run_dir(self._runs_dir, self.name)
        self.dir = rd.path
        self._rd = rd
        try:
            write_atomic(rd.script, PRELUDE + POOL_SCRIPT)
            self._listen()
            jd_env = self._jd_env()
            secret_env = {"JD_POOL_ADDR": str(self.address), "JD_POOL_KEY": self._key.hex(),
                          "JD_POOL_KERNEL_PID": str(os.getpid())}  # fmt: skip
            lau = LocalLauncher(run_dir=rd, nproc=self.nproc, extra_env={**jd_env, **secret_env})
            record = RunRecord(
                name=self.name, kind="pool", backend=lau.kind, strategy=self.strategy,
                candidate=self.choice.candidate.name, degrees=self.choice.degrees,
                notes=(self.choice.mesh(),), world_size=self.world_size, nproc=self.nproc, nodes=1,
                created=time.time(), env=scrub_env({k: v for k, v in lau.env().items() if k not in secret_env}),
                plan=self.plan.to_dict() if self.plan is not None else None, versions=kernel_versions(),
                extra={"control": self.address},
            )  # fmt: skip
            self._note(f"starting {self.nproc} ranks; control channel on {self.address}")
            meta, procs = start_recorded(rd, record, lau)
            self.run = Run(rd, meta, procs=procs, launcher=lau, plan=self.plan)
            _LIVE.add(self)
            self._wait_connected()
        except BaseException:
            self.stop(grace=2.0)
            raise
        self.state = "ready"
        self._note("ready: " + ", ".join(f"rank {r} pid {c.pid}" for r, c in sorted(self._conns.items())))
        return self

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can even connect
        sock.listen(64)
        sock.settimeout(0.5)
        self._listener = sock
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="jd-pool-accept", daemon=True)
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):  # a flood of connections: no thread, no memory each
                self._refuse(f"{peer[0]}:{peer[1]}", f"more than {MAX_PENDING_HANDSHAKES} connections waiting for "
                             "their hello", None, sock)  # fmt: skip
                continue
            threading.Thread(target=self._handshake, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="jd-pool-handshake").start()  # fmt: skip

    def _refuse(self, peer: str, reason: str, channel: Channel | None, sock: socket.socket) -> None:
        self.refused.append({"t": time.time(), "peer": peer, "reason": reason})
        self.refused_total += 1
        if self.refused_total <= MAX_REFUSED_KEPT or self.refused_total % 1000 == 0:  # a flood cannot fill the disk
            _log.warning("jupyter-dist pool: refused a connection from %s: %s", peer, reason)
            self._note(f"refused a connection from {peer}: {reason} ({self.refused_total} refused so far)")
        if channel is not None:
            channel.close()
        else:
            try:
                sock.close()
            except OSError:
                pass

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            self._handshake_within(sock, peer)
        finally:
            self._handshakes.release()

    def _handshake_within(self, sock: socket.socket, peer: str) -> None:
        channel = None
        # the whole hello must arrive within HANDSHAKE_TIMEOUT: a peer trickling one byte at a time (slowloris) would
        # otherwise hold its thread forever, as each recv() restarts the socket timeout
        expired = threading.Event()
        deadline = threading.Timer(HANDSHAKE_TIMEOUT, _shutdown, args=(sock, expired))
        deadline.daemon = True
        deadline.start()
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(NONCE_SIZE)
            sock.sendall(nonce)
            channel = Channel(sock, self._key, nonce, kernel_side=True)
            header, _ = channel.recv(max_size=MAX_UNAUTHENTICATED)
        except AuthError as exc:
            self._refuse(peer, str(exc), channel, sock)
            return
        except (ChannelClosed, OSError, ValueError) as exc:
            late = expired.is_set()
            why = f"no complete hello within {HANDSHAKE_TIMEOUT:g} s" if late else f"{type(exc).__name__}: {exc}"
            self._refuse(peer, f"no signed hello ({why})", channel, sock)
            return
        finally:
            deadline.cancel()
        rank, pid = header.get("rank"), header.get("pid")
        with self._lock:
            if header.get("op") != "hello" or not isinstance(rank, int) or not isinstance(pid, int):
                reason = f"expected a hello with rank and pid, got {header.get('op')!r}"
            elif not 0 <= rank < self.world_size:
                reason = f"rank {rank} is not in this pool (0..{self.world_size - 1})"
            elif rank in self._conns:
                reason = f"rank {rank} is already connected"
            else:
                reason = ""
                conn = _Conn(rank=rank, pid=pid, channel=channel, peer=peer)
                self._conns[rank] = conn
        if reason:
            self._refuse(peer, reason, channel, sock)
            return
        sock.settimeout(None)
        channel.send({"op": "welcome"})
        conn.thread = threading.Thread(target=self._read_loop, args=(conn,), name=f"jd-pool-rank-{rank}", daemon=True)
        conn.thread.start()
        self._note(f"rank {rank} (pid {pid}) connected from {peer}")
        with self._lock:
            if len(self._conns) == self.world_size:
                self._all_connected.set()

    def _read_loop(self, conn: _Conn) -> None:
        while True:
            try:
                header, blob = conn.channel.recv()
            except AuthError as exc:
                reason = f"refused a message from rank {conn.rank}: {exc}"
                _log.warning("jupyter-dist pool: %s", reason)
                self._note(reason)
                conn.channel.close()
                self._queue.put((conn.rank, {"op": "_lost", "reason": reason}, None))
                return
            except (ChannelClosed, OSError) as exc:
                reason = f"connection lost ({exc})"
                self._queue.put((conn.rank, {"op": "_lost", "reason": reason}, None))
                if not self._closing.is_set():
                    self._lost.setdefault(conn.rank, reason)
                return
            self._queue.put((conn.rank, header, blob))

    def _wait_connected(self) -> None:
        assert self.run is not None
        deadline = time.monotonic() + self._start_timeout
        while not self._all_connected.wait(0.2):
            if self.run.done:
                raise PoolBroken(f"the ranks ended before they connected: {self._launch_failure()}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self._conns))
                raise PoolBroken(
                    f"rank(s) {', '.join(map(str, missing))} did not connect within {self._start_timeout:g} s; "
                    f"see {self._rd.logs}"
                )

    def _launch_failure(self) -> str:
        assert self.run is not None
        for r in range(self.world_size):
            tail = self.run.logs(r, tail=8).strip()
            if "Error" in tail or "error" in tail:
                return f"rank {r}: " + tail.splitlines()[-1]
        return (self.run.launcher_log().strip().splitlines() or ["(torchrun printed nothing)"])[-1]

    # ---------------------------------------------------------------- state
    @property
    def ranks(self) -> list[int]:
        """Every rank of the pool."""
        return list(range(self.world_size))

    @property
    def pids(self) -> dict[int, int]:
        """Process id of each rank."""
        return {r: c.pid for r, c in sorted(self._conns.items())}

    def _note(self, text: str) -> None:
        if self.dir is None:
            return
        try:
            with open(self.dir / "logs" / "pool.log", "a", encoding="utf-8") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        except OSError:
            pass

    def _check_usable(self) -> None:
        if self.state in ("before", "starting"):
            raise PoolError("the pool is not started yet")
        if self.state == "stopped":
            raise PoolError("the pool is stopped; start a new one with %dist_start")
        if self._lost and self.state != "broken":
            self._broken(self._lost)
        if self.run is not None and self.run.done and self.state != "broken":
            self._broken({r: "the torchrun job ended" for r in self.ranks})
        if self.state == "broken":
            raise PoolBroken(f"the pool is broken: {self.reason}; %dist_stop, then %dist_start a new one")

    def _broken(self, lost: dict[int, str]) -> None:
        """Mark the pool broken; the reason names the rank(s) and why (exit code or signal, last log lines)."""
        first = min(lost)
        info = self._exit_info()
        culprit = info.get("rank", first) if info else first
        parts = [f"rank {culprit} died"]
        if info.get("how"):
            parts[0] += f" ({info['how']})"
        else:
            parts[0] += f" ({lost.get(culprit, lost[first])})"
        tail = self.run.logs(culprit, tail=3).strip() if self.run is not None else ""
        if tail:
            parts.append("its last log lines: " + " | ".join(ln.strip() for ln in tail.splitlines()))
        self.reason = "; ".join(parts)
        self.state = "broken"
        self._note(f"broken: {self.reason}")

    def _exit_info(self, wait: float = 10.0) -> dict[str, Any]:
        """How the failed rank ended, from torchrun's failure summary (it ends the other ranks, then reports)."""
        if self.run is None:
            return {}
        self.run.wait(wait)  # torchrun notices the dead worker, stops the others and exits
        text = self.run.launcher_log()
        if "Root Cause" in text:  # torchrun lists the ranks it terminated itself first, the root cause after
            text = text.rsplit("Root Cause", 1)[1]
        m = re.search(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)
        if m:
            rank, code = int(m.group(1)), int(m.group(2))
            if code < 0:
                try:
                    sig = signal.Signals(-code).name
                except ValueError:
                    sig = f"signal {-code}"
                return {"rank": rank, "how": f"killed by {sig}, exit code {code}"}
            return {"rank": rank, "how": f"exit code {code}"}
        codes = {r: c for r, c in self.run.exit_codes.items() if c not in (None, 0)}
        if codes:
            r = min(codes)
            return {"rank": r, "how": f"exit code {codes[r]}"}
        return {}

    # ---------------------------------------------------------------- requests
    def _send(self, ranks: list[int], header: dict[str, Any], blob: Any = b"") -> int:
        self._request += 1
        rid = self._request
        for r in ranks:
            try:
                self._conns[r].channel.send({**header, "id": rid}, blob)
            except ChannelClosed as exc:
                self._lost.setdefault(r, f"connection lost ({exc})")
        return rid

    def _signal(self, ranks: list[int] | set[int], sig: int) -> None:
        for r in sorted(ranks):
            conn = self._conns.get(r)
            if conn is None:
                continue
            try:
                os.kill(conn.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait(self, rid: int, ranks: list[int], *, timeout: float | None = None,
              on_output: Callable[[int, str, str], None] | None = None,
              on_idle: Callable[[], None] | None = None) -> _Wait:  # fmt: skip
        """Collect the replies to request ``rid``; forward a kernel interrupt and ``timeout`` to the ranks."""
        result = _Wait()
        pending = {r for r in ranks if r not in self._lost}
        result.lost.update({r: self._lost[r] for r in ranks if r in self._lost})
        start = time.monotonic()
        interrupted_at: float | None = None
        handled = 0
        ended_at: float | None = None
        flag = self._flag if self._flag is not None else _InterruptFlag()
        with contextlib.nullcontext() if self._flag is not None else flag:
            while pending:
                try:
                    item: tuple[int, dict[str, Any], Any] | None = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = None
                    if on_idle is not None:
                        on_idle()
                except KeyboardInterrupt:  # not the main thread: the signal arrived as an exception
                    item = None
                    flag.count += 1
                if item is not None:
                    rank, header, blob = item
                    op = header.get("op")
                    if op == "_lost":
                        if rank in pending:
                            pending.discard(rank)
                            result.lost[rank] = str(header.get("reason"))
                    elif op == "stream":
                        if on_output is not None:
                            on_output(rank, str(header.get("name")), str(header.get("text", "")))
                        else:
                            self._stray.append((rank, str(header.get("name")), str(header.get("text", ""))))
                    elif op == "done" and header.get("id") == rid and rank in pending:
                        pending.discard(rank)
                        result.replies[rank] = _Reply(header, blob)
                now = time.monotonic()
                if flag.count > handled:
                    handled = flag.count
                    result.interrupted = True
                    if interrupted_at is None:
                        interrupted_at = now
                        self._note(f"kernel interrupt: SIGINT to rank(s) {sorted(pending)}")
                        self._signal(pending, signal.SIGINT)
                    else:  # interrupted again: stop waiting
                        result.stuck = sorted(pending)
                        break
                if timeout is not None and not result.timed_out and now - start > timeout:
                    result.timed_out = True
                    result.where = self._where(sorted(pending))
                    self._note(f"timeout after {timeout:g} s: SIGINT to rank(s) {sorted(pending)}")
                    interrupted_at = now
                    self._signal(pending, signal.SIGINT)
                if interrupted_at is not None and now - interrupted_at > self.interrupt_grace:
                    result.stuck = sorted(pending)
                    break
                if self.run is not None and self.run.done:  # torchrun is gone: so are the ranks
                    ended_at = ended_at or now
                    if now - ended_at > 3.0:
                        result.lost.update({r: "the torchrun job ended" for r in pending})
                        break
        if result.stuck:
            if not result.where:
                result.where = self._where(result.stuck)
            where = "; ".join(f"rank {r} at {result.where.get(r, '?')}" for r in result.stuck)
            self.reason = (f"rank(s) {', '.join(map(str, result.stuck))} did not stop after the interrupt "
                           f"(blocked in native code, e.g. a collective its peers never joined): {where}")  # fmt: skip
            self.state = "broken"
            self._note(f"broken: {self.reason}")
        return result

    def _where(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's cell line (and innermost frame) from a faulthandler dump (SIGUSR1, registered by bootstrap)."""
        if not ranks or self.run is None:
            return {}
        logs = {r: self._rd.rank_log(r) for r in ranks}
        marks = {r: (p.stat().st_size if p.exists() else 0) for r, p in logs.items()}
        self._signal(ranks, signal.SIGUSR1)
        texts: dict[int, str] = {}


        def read() -> None:
            for r in ranks:
                try:
                    with open(logs[r], "rb") as fh:
                        fh.seek(marks[r])
                        texts[r] = fh.read().decode("utf-8", "replace")
                except OSError:
                    texts[r] = ""

        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            read()
            if all("Current thread" in t and t.rstrip().endswith(")") or "<dist-cell-" in t for t in texts.values()):
                time.sleep(0.2)  # the dump is written in one go; give it a moment to finish
                break
            time.sleep(0.1)
        read()
        return {r: self._locate(texts.get(r, "")) for r in ranks}

    def _locate(self, dump: str) -> str:
        """The cell line in a faulthandler dump: the thread running a cell (the main one), innermost frame first."""
        blocks = _THREAD_RE.split(dump)[1:] or [dump]
        frames_by_thread = [_FRAME_RE.findall(b) for b in blocks]
        frames = next((fs for fs in frames_by_thread if any(f[0].startswith("<dist-cell-") for f in fs)), None)
        if frames is None:
            current = dump.rsplit("Current thread", 1)[-1] if "Current thread" in dump else dump
            frames = _FRAME_RE.findall(current)
            if not frames:
                return "no stack (the rank did not answer SIGUSR1)"
            fname, line, func = frames[0]
            return f"{Path(fname).name}:{line} in {func} (not in a cell)"
        for fname, line, _func in frames:  # most recent call first
            if fname.startswith("<dist-cell-"):
                src = self._sources.get(fname, "").splitlines()
                n = int(line)
                code = src[n - 1].strip() if 0 < n <= len(src) else ""
                text = f"cell line {n}: {code}" if code else f"{fname} line {n}"
                inner = frames[0]
                if not inner[0].startswith("<dist-cell-"):
                    text += f" (inside {Path(inner[0]).name}:{inner[1]} in {inner[2]})"
                return text
        return "no cell frame"

    def execute(self, code: str, *, ranks: list[int] | None = None, timeout: float | None = None,
                on_output: Callable[[int, str, str], None] | None = None,
                on_idle: Callable[[], None] | None = None) -> CellResult:  # fmt: skip
        """Run ``code`` on ``ranks`` (default: all) and wait; returns every rank's output, value and error.

        ``on_output(rank, "stdout"|"stderr", text)`` is called (in this thread) as output arrives, ``on_idle()``
        whenever no message came for 50 ms (to refresh a display). A kernel
        interrupt interrupts the cell on every rank and raises :class:`PoolInterrupted` once they stopped; past
        ``timeout`` seconds the cell is interrupted and the result says where each rank was (``timed_out``). A
        rank that dies raises :class:`PoolBroken`. An exception in the cell does not raise: see
        :attr:`CellResult.failed`.
        """
        if timeout is not None and not timeout > 0:
            raise PoolError(f"--timeout must be positive seconds, got {timeout}")
        targets = self.ranks if ranks is None else parse_ranks(",".join(map(str, ranks)), self.world_size)
        texts: dict[int, dict[str, list[str]]] = {r: {"stdout": [], "stderr": []} for r in targets}

        def collect(rank: int, stream: str, text: str) -> None:
            if rank in texts and stream in texts[rank]:
                texts[rank][stream].append(text)
            if on_output is not None:
                on_output(rank, stream, text)

        with self._op():
            t0 = time.monotonic()
            name = f"<dist-cell-{self._request + 1}>"
            self._sources[name] = code
            if len(self._sources) > 500:
                self._sources.pop(next(iter(self._sources)))
            rid = self._send(targets, {"op": "exec", "code": code, "name": name})
            try:
                waited = self._wait(rid, targets, timeout=timeout, on_output=collect, on_idle=on_idle)
            finally:
                self.cells += 1
        result = CellResult(ranks={r: RankReport(rank=r) for r in targets}, elapsed=time.monotonic() - t0,
                            interrupted=waited.interrupted, timed_out=waited.timed_out, timeout=timeout)  # fmt: skip
        for r, streams in texts.items():
            result.ranks[r].stdout = "".join(streams["stdout"])
            result.ranks[r].stderr = "".join(streams["stderr"])
        for r, reply in waited.replies.items():
            rep = result.ranks[r]
            rep.value = reply.header.get("value")
            rep.error = reply.header.get("error")
            rep.interrupted = bool(reply.header.get("interrupted"))
            rep.elapsed = reply.header.get("elapsed")
        for r, where in waited.where.items():
            result.ranks[r].where = where
        for r in waited.stuck:
            result.ranks[r].error = {"ename": "KeyboardInterrupt", "evalue": "did not stop",
                                     "traceback": f"rank {r} did not stop after the interrupt\n"}  # fmt: skip
        self._fill_where_from_tracebacks(result)
        self.last = result
        flags = (" (interrupted)" if result.interrupted else "") + (" (timed out)" if result.timed_out else "")
        self._note(f"cell {name} on ranks {targets}: {result.elapsed:.3f} s, failed {result.failed}{flags}")
        self._raise_if_lost(waited, result)
        if waited.stuck:
            raise PoolBroken(f"the pool is broken: {self.reason}; %dist_stop, then %dist_start a new one")
        if result.interrupted:
            raise PoolInterrupted(result)
        return result

    def _fill_where_from_tracebacks(self, result: CellResult) -> None:
        """An interrupted rank's traceback says where it was (when no faulthandler dump was taken)."""
        for rep in result.ranks.values():
            if rep.where or not rep.interrupted or rep.error is None:
                continue
            hits = _CELL_RE.findall(rep.error.get("traceback", ""))
            if hits:
                fname, line = hits[-1]
                src = self._sources.get(fname, "").splitlines()
                n = int(line)
                rep.where = f"cell line {n}: {src[n - 1].strip()}" if 0 < n <= len(src) else f"{fname} line {n}"

    def _raise_if_lost(self, waited: _Wait, result: CellResult | None = None) -> None:
        if not waited.lost:
            return
        self._lost.update({r: why for r, why in waited.lost.items() if r not in self._lost})
        if self.state != "broken":
            self._broken(waited.lost)
        if result is not None:
            for r, why in waited.lost.items():
                if r in result.ranks:
                    result.ranks[r].lost = why
        raise PoolBroken(f"the pool is broken: {self.reason}; %dist_stop, then %dist_start a new one")

    class _OpGuard:
        def __init__(self, pool: Pool) -> None:
            self.pool = pool

        def __enter__(self) -> None:
            pool = self.pool
            pool._check_usable()
            if not pool._busy.acquire(blocking=False):
                raise PoolError("the pool is busy with another cell (one request at a time)")
            pool.state = "busy"
            # from before the request is sent: an interrupt can never fall between sending and waiting
            pool._flag = _InterruptFlag().__enter__()

        def __exit__(self, *exc: Any) -> None:
            pool = self.pool
            if pool._flag is not None:
                pool._flag.__exit__()
                pool._flag = None
            if pool.state == "busy":
                pool.state = "ready"
            pool._busy.release()

    def _op(self) -> Pool._OpGuard:
        return Pool._OpGuard(self)

    def push(self, objects: dict[str, Any], *, ranks: list[int] | None = None) -> None:
        """Bind ``objects`` (name -> value, sent with cloudpickle) in the namespace of ``ranks`` (default: all)."""
        import pickle

        import cloudpickle

        for name in objects:
            if not str(name).isidentifier():
                raise PoolError(f"{name!r} is not a variable name")
        targets = self.ranks if ranks is None else parse_ranks(",".join(map(str, ranks)), self.world_size)
        try:
            blob = cloudpickle.dumps(dict(objects), protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise PoolError(f"cannot send {', '.join(objects)} to the ranks: {exc}") from None
        with self._op():
            rid = self._send(targets, {"op": "push", "names": sorted(objects)}, blob)
            waited = self._wait(rid, targets)
        self._raise_if_lost(waited)
        if waited.interrupted:  # the transfer finished (an idle rank ignores SIGINT); the kernel's interrupt stands
            raise KeyboardInterrupt
        errors = {r: rep.header.get("error") for r, rep in waited.replies.items() if not rep.header.get("ok")}
        if errors:
            r = min(errors)
            err = errors[r] or {}
            raise PoolError(f"rank {r} could not load {', '.join(objects)}: {err.get('ename')}: {err.get('evalue')}")

    def pull(self, name: str, *, rank: int = 0, gather: bool = False) -> Any:
        """The value of ``name`` on ``rank``, tensors as CPU tensors.

        A DTensor comes back as the rank's local shard, or as the full tensor with ``gather=True`` (a collective:
        every rank takes part).
        """
        return self._pull(name, [rank], gather=gather, only=rank)[rank]

    def pull_all(self, name: str, *, gather: bool = False) -> dict[int, Any]:
        """``{rank: value}`` of ``name`` from every rank."""
        return self._pull(name, self.ranks, gather=gather, only=None)

    def _pull(self, name: str, ranks: list[int], *, gather: bool, only: int | None) -> dict[int, Any]:
        import cloudpickle

        if not str(name).isidentifier():
            raise PoolError(f"{name!r} is not a variable name")
        if only is not None and not 0 <= only < self.world_size:
            raise PoolError(f"--rank {only}: the pool has ranks 0..{self.world_size - 1}")
        targets = self.ranks if gather else ranks
        with self._op():
            rids = {}
            self._request += 1
            rid = self._request
            for r in targets:
                send = only is None or r == only
                try:
                    self._conns[r].channel.send({"op": "pull", "name": name, "gather": gather, "send": send,
                                                 "id": rid})  # fmt: skip
                except ChannelClosed as exc:
                    self._lost.setdefault(r, f"connection lost ({exc})")
                rids[r] = rid
            waited = self._wait(rid, targets)
        self._raise_if_lost(waited)
        if waited.interrupted:  # the transfer finished (an idle rank ignores SIGINT); the kernel's interrupt stands
            raise KeyboardInterrupt
        errors = {r: rep.header.get("error") or {} for r, rep in waited.replies.items() if not rep.header.get("ok")}
        if errors:
            r = min(errors)
            raise PoolError(f"%dist_pull {name} (rank {r}): {errors[r].get('ename')}: {errors[r].get('evalue')}")
        out = {}
        for r in ranks:
            reply = waited.replies[r]
            out[r] = cloudpickle.loads(reply.blob)
        return out

    def interrupt(self) -> None:
        """Send SIGINT to every rank (a running cell raises KeyboardInterrupt there; an idle rank ignores it)."""
        self._signal(self.ranks, signal.SIGINT)

    # ---------------------------------------------------------------- stop
    def stop(self, *, grace: float = 10.0) -> None:
        """End every rank (asked to shut down, then SIGTERM/SIGKILL after ``grace`` s); idempotent."""
        if self.state == "stopped":
            return
        was = self.state
        self._closing.set()
        run = self.run
        if run is not None and not run.done:
            run.expect_stop(STOPPED)
            if was in ("ready", "busy"):
                for conn in list(self._conns.values()):
                    try:
                        conn.channel.send({"op": "shutdown", "id": 0})
                    except ChannelClosed:
                        pass
                run.wait(grace)
            if not run.done:
                run.stop(grace=min(grace, 3.0))
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        for conn in list(self._conns.values()):
            conn.channel.close()
        # ranks whose torchrun agent went away first (never expected): end them by pid, checked to be ours
        leftovers = []
        for conn in self._conns.values():
            try:
                proc = psutil.Process(conn.pid)
                if proc.environ().get("JD_RUN_DIR") == str(self.dir):
                    leftovers.append(conn.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if leftovers:
            kill_tree(leftovers, grace=2.0)
        self.state = "stopped"
        _LIVE.discard(self)
        self._note("stopped")

    def __enter__(self) -> Pool:
        return self if self.state != "before" else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---------------------------------------------------------------- display
    def dashboard(self, **kwargs: Any) -> Any:
        """The live panels of the pool's telemetry (``jd.log`` in cells), as for a run; display the result."""
        if self.run is None:
            raise PoolError("the pool is not started yet")
        return self.run.dashboard(**kwargs)

    def summary(self) -> str:
        """One paragraph: state, ranks, directory, and why it is broken."""
        pids = ", ".join(f"{r}:{p}" for r, p in self.pids.items())
        lines = [f"Pool {self.dir.name if self.dir else self.name}: {self.state} ({self.world_size} ranks, "
                 f"strategy {self.strategy}; {self.cells} cells run)"]  # fmt: skip
        if pids:
            lines.append(f"  pids: {pids}")
        if self.dir is not None:
            lines.append(f"  dir: {self.dir}")
        if self.address:
            lines.append(f"  control: {self.address} (HMAC-SHA256 signed, loopback only)")
        if self.reason:
            lines.append(f"  broken: {self.reason}")
        if self.refused_total:
            lines.append(f"  refused connections: {self.refused_total} (see logs/pool.log)")
        return "\n".join(lines)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        colour = {"ready": "#2e7d32", "busy": "#1565c0", "broken": "#c62828"}.get(self.state, "#555")
        body = html.escape(self.summary())
        return {"text/plain": self.summary(),
                "text/html": f'<div style="border-left:4px solid {colour};padding:4px 8px"><pre style="margin:0">'
                             f"{body}</pre></div>"}  # fmt: skip

    def __repr__(self) -> str:
        return f"Pool(state={self.state!r}, world_size={self.world_size}, dir={str(self.dir)!r})"


def start_pool(**kwargs: Any) -> Pool:
    """Build a :class:`Pool` with these arguments and start it."""
    return Pool(**kwargs).start()


@atexit.register
def _stop_live_pools() -> None:  # the kernel is going away: leave no rank behind
    for pool in list(_LIVE):
        try:
            pool.stop(grace=3.0)
        except Exception:  # never block interpreter exit
            pass
