"""Runs inside every worker, before the user's script: ``python -m jupyter_dist.launch.bootstrap SCRIPT [ARGS]``.

torchrun starts it as each rank's program. It sends the rank's stdout/stderr to ``logs/rank-<k>.log`` (or, with
``JD_LOG_STREAM=1`` on a cluster whose output is one log stream, prefixes each line with ``[rank <k>] ``), loads the
objects shipped from the notebook (cloudpickle) into the script's globals, runs the script as ``__main__``, and
records the rank's exit code and error in ``logs/rank-<k>.exit.json`` for the Run handle.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .._atomic import write_atomic
from .._startup import import_torch_outside_the_collector


def _redirect(log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)


class _RankPrefix(io.TextIOBase):
    """Writes each complete line as ``[rank K] line`` to ``target`` (output that goes to a shared log stream)."""

    def __init__(self, target: Any, rank: int) -> None:
        self._target = target
        self._prefix = f"[rank {rank}] "
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        data = self._partial + text
        *lines, self._partial = data.split("\n")
        if lines:
            self._target.write("".join(f"{self._prefix}{ln}\n" for ln in lines))
            self._target.flush()
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:
        return int(self._target.fileno())


def _stream(rank: int) -> None:
    """Stream mode (``JD_LOG_STREAM=1``, cluster back-ends): keep stdout/stderr, prefix Python's lines with the rank."""
    sys.stdout = _RankPrefix(sys.stdout, rank)
    sys.stderr = _RankPrefix(sys.stderr, rank)


def _shipped(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "shipped.pkl"
    if not path.exists():
        return {}
    import cloudpickle

    with open(path, "rb") as fh:
        objects: dict[str, Any] = cloudpickle.load(fh)
    return objects


def _note_exit(code: int, exc: BaseException | None) -> None:
    """Tell the worker API (when the script imported it) how the rank ended, for its ``exit`` record."""
    worker = sys.modules.get("jupyter_dist.worker")
    if worker is not None:
        try:
            worker.note_exit(code, exc)
        except Exception:  # never let telemetry hide the real error
            pass


def _record_os_exit(run_dir: Path, rank: int, script: str) -> None:
    """Make ``os._exit`` in the rank's own process leave an exit record marked ``early`` first.

    ``os._exit`` skips the script's end (and the process-group teardown): the other ranks would wait for this one
    in their next collective until gloo's 30-minute timeout. The record lets the Run handle see it and stop the
    run with a diagnosis instead. Children the rank forks (DataLoader workers, ``os.fork``) end with ``os._exit``
    too; they are not the rank and pass straight through.
    """
    real_exit = os._exit
    me = os.getpid()

    def _exit(code: int) -> None:
        if os.getpid() == me:
            where = None
            frame = sys._getframe(1)
            while frame is not None:
                if Path(frame.f_code.co_filename) == Path(script):
                    where = f"script.py:{frame.f_lineno}"
                    break
                frame = frame.f_back  # type: ignore[assignment]
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                record = {"rank": rank, "code": code, "error": None, "early": True, "where": where, "t": time.time()}
                write_atomic(run_dir / "logs" / f"rank-{rank}.exit.json", json.dumps(record))
            except (OSError, ValueError):
                pass
        real_exit(code)

    os._exit = _exit  # type: ignore[assignment]


def _check_versions() -> None:
    """Before the cell: one line per package whose version differs from the kernel's (``JD_VERSIONS``)."""
    expected = os.environ.get("JD_VERSIONS", "").strip()
    if not expected:
        return
    from .remote_env import parse_versions, version_mismatches

    try:
        lines = version_mismatches(parse_versions(expected))
    except Exception as exc:  # noqa: BLE001 - a check must never stop the run
        lines = [f"jupyter-dist: could not compare versions with the kernel's: {exc}"]
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def _enter_project() -> None:
    """Start where the notebook is, with its modules importable.

    ``JD_CWD`` (a cluster job's ranks; local ranks are started there) becomes the working directory and first on
    ``sys.path``; the kernel's project folders (``JD_PATH``) follow it.
    """
    cwd = os.environ.get("JD_CWD")
    if cwd:
        try:
            os.chdir(cwd)
            sys.path.insert(0, cwd)
        except OSError as exc:  # the notebook's folder is not on this node: say so once, stay where the job started
            print(f"jupyter-dist: the notebook's folder {cwd} is not reachable on this node ({exc.strerror}); "
                  f"running in {os.getcwd()} (give --workdir to copy the project)", file=sys.stderr, flush=True)
    for entry in reversed([p for p in os.environ.get("JD_PATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]`` as this rank's script; return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m jupyter_dist.launch.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(os.environ.get("JD_RUN_DIR", "."))
    if os.environ.get("JD_LOG_STREAM") == "1":
        _stream(rank)
    else:
        _redirect(run_dir / "logs" / f"rank-{rank}.log")
    if hasattr(faulthandler, "register"):  # SIGUSR1 dumps every thread's stack into the log (hang diagnosis)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    _record_os_exit(run_dir, rank, args[0])
    _check_versions()
    _enter_project()
    code, error = 0, None
    try:
        import_torch_outside_the_collector()  # before the shipped objects, whose unpickling imports torch
        init = _shipped(run_dir)
        sys.argv = args
        runpy.run_path(args[0], init_globals=init, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        _note_exit(code, exc if code else None)
    except BaseException as exc:  # the rank's failure: keep its traceback (from the script down) in its log
        _note_exit(1, exc)
        tb = exc.__traceback__
        while tb is not None and Path(tb.tb_frame.f_code.co_filename) != Path(args[0]):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
        code = 1
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    record = {"rank": rank, "code": code, "error": error, "t": time.time()}
    try:
        write_atomic(run_dir / "logs" / f"rank-{rank}.exit.json", json.dumps(record))
    except OSError:
        pass
    _stream_exit(rank, code, error)
    return code


def _stream_exit(rank: int, code: int, error: str | None) -> None:
    """On a log-stream back-end (SkyPilot), print the ``exit`` record a script that never imported ``jd`` lacks.

    After the sentinel, so the Run learns this rank's exit code as for any cell (plain torch.distributed scripts).
    """
    if os.environ.get("JD_TELEMETRY_STDOUT") != "1" or "jupyter_dist.worker" in sys.modules:
        return
    from ..telemetry.records import SENTINEL, encode, make_record

    fields: dict[str, Any] = {"status": "ok" if code == 0 else "error"}
    if error:
        kind, _, message = error.partition(": ")
        fields.update(error_type=kind, error=message)
    elif code:
        fields.update(error_type="SystemExit", error=str(code))
    rec = make_record("exit", rank=rank, seq=int(time.time() * 1000), t=time.time(), **fields)
    try:
        print(SENTINEL + encode(rec), flush=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
