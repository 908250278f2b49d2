"""Magics of the interactive pool: ``%dist_start``, ``%%dist``, ``%dist_push``, ``%dist_pull``, ``%dist_mode``.

Thin: parse the line, call :class:`jupyter_dist.pool.kernel.Pool`, show the outputs. ``%dist_stop`` (in
:mod:`jupyter_dist.magics.dist`) ends the pool through :func:`route_stop`.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

import traitlets
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser

from ..cli.flags import MAX_COUNT, MAX_LOCAL_NPROC, MAX_SECONDS, float_arg, int_arg
from ..errors import JupyterDistError
from .args import parse_magic_line

__all__ = ["PoolMagics", "register", "route_stop", "unregister"]

_SHOWN_CHARS = 200_000
"""Characters of a rank's output kept in the live view (all of it stays in ``pool.last``)."""


def _start_parser() -> MagicArgumentParser:
    from ..launch.session import STRATEGY_CHOICES

    p = MagicArgumentParser(prog="%dist_start", add_help=False,  # type: ignore[no-untyped-call]
                            description="Start a pool of ranks that keep their state from cell to cell.")  # fmt: skip
    p.add_argument("--nproc", type=int_arg(1, MAX_LOCAL_NPROC), default=2, help="number of ranks (default 2)")
    p.add_argument("--strategy", default="auto", help=f"what jd.wrap applies: {', '.join(STRATEGY_CHOICES)}")
    p.add_argument("--plan", metavar="VAR", help="a Plan object from the notebook (strategy, precision, configs)")
    p.add_argument("--name", metavar="VAR", help="also bind the Pool to this notebook variable")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for the ranks")
    p.add_argument("--oversubscribe", action="store_true",
                   help="start more ranks than the machine holds (one per GPU, else 4 per CPU core)")  # fmt: skip
    p.add_argument("--runs-dir", help="where the pool's run directory goes (default: the DistMagics.runs_dir setting)")
    p.add_argument("--start-timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), default=120.0, metavar="S",
                   help="seconds to wait for every rank to connect (default 120)")  # fmt: skip
    p.add_argument("--dashboard", action="store_true", help="show live panels (jd.log in cells) under this cell")
    p.add_argument("--dry-run", action="store_true", help="show the command and environment; start nothing")
    return p


def _cell_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%%dist", add_help=False,  # type: ignore[no-untyped-call]
                            description="Run the cell on every rank of the pool (or on --ranks).")  # fmt: skip
    p.add_argument("--ranks", metavar="R", help="ranks to run on: 0,1 or 0-3 or all (default all)")
    p.add_argument("--timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), metavar="S",
                   help="interrupt the cell after S seconds and report where each rank was")  # fmt: skip
    return p


def _push_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist_push", add_help=False,  # type: ignore[no-untyped-call]
                            description="Send notebook variables to the ranks (cloudpickle).")  # fmt: skip
    p.add_argument("names", metavar="NAME[,NAME...]", help="notebook variables to send")
    p.add_argument("--ranks", metavar="R", help="ranks to send to: 0,1 or 0-3 or all (default all)")
    return p


def _pull_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist_pull", add_help=False,  # type: ignore[no-untyped-call]
                            description="Fetch a variable from a rank (tensors on the CPU).")  # fmt: skip
    p.add_argument("name", metavar="NAME", help="variable on the ranks")
    p.add_argument("--rank", type=int_arg(0, MAX_COUNT), default=None, help="the rank to fetch from (default 0)")
    p.add_argument("--all", action="store_true", help="fetch from every rank: a dict {rank: value}")
    p.add_argument("--gather", action="store_true",
                   help="DTensors: the full tensor (all ranks take part), not the local shard")  # fmt: skip
    p.add_argument("--as", dest="as_", metavar="VAR", help="notebook variable to bind (default: NAME)")
    return p


def _mode_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(prog="%dist_mode", add_help=False,  # type: ignore[no-untyped-call]
                            description="on: the following cells run on the pool; off: locally.")  # fmt: skip
    p.add_argument("state", nargs="?", help="on or off (no argument: show the mode)")
    p.add_argument("--ranks", metavar="R", help="%%dist --ranks for the cells (default all)")
    p.add_argument(
        "--timeout", type=float_arg(0.0, MAX_SECONDS, lo_open=True), metavar="S", help="%%dist --timeout for the cells"
    )
    return p


def _describe(value: Any) -> str:
    """A short description of a pulled object: type, and shape/dtype for tensors."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    text = type(value).__name__
    if shape is not None:
        text += f"(shape={tuple(shape)}, dtype={dtype}, device={getattr(value, 'device', '?')})"
    elif isinstance(value, (list, tuple, dict, set)):
        text += f"(len={len(value)})"
    return text


class _LiveOutput:
    """Shows the ranks' output as it arrives: grouped per rank in one display (kernel), or prefixed lines (terminal)."""

    def __init__(self, shell: Any, ranks: list[int]) -> None:
        self.grouped = getattr(shell, "kernel", None) is not None
        self.ranks = ranks
        self.texts: dict[int, list[str]] = {r: [] for r in ranks}
        self.sizes: dict[int, int] = {r: 0 for r in ranks}
        self.dropped: dict[int, int] = {r: 0 for r in ranks}
        self.partial: dict[tuple[int, str], str] = {}
        self.handle: Any = None
        self.last = 0.0
        self.dirty = False

    def __call__(self, rank: int, stream: str, text: str) -> None:
        if not self.grouped:
            buf = self.partial.get((rank, stream), "") + text
            *lines, rest = buf.split("\n")
            self.partial[(rank, stream)] = rest
            out = sys.stderr if stream == "stderr" else sys.stdout
            for line in lines:
                out.write(f"[rank {rank}] {line}\n")
            out.flush()
            return
        parts = self.texts.setdefault(rank, [])
        parts.append(text)
        self.sizes[rank] = self.sizes.get(rank, 0) + len(text)
        while self.sizes[rank] > _SHOWN_CHARS and len(parts) > 1:
            gone = parts.pop(0)
            self.sizes[rank] -= len(gone)
            self.dropped[rank] = self.dropped.get(rank, 0) + len(gone)
        self.dirty = True
        if time.monotonic() - self.last > 0.2:
            self.refresh()

    def tick(self) -> None:
        """Called while the kernel waits: show what arrived since the last refresh (at most 5 times a second)."""
        if self.grouped and self.dirty and time.monotonic() - self.last > 0.2:
            self.refresh()

    def _bundle(self, values: dict[int, str] | None = None) -> dict[str, str]:
        blocks = []
        for r in sorted(self.texts):
            body = "".join(self.texts[r])
            if self.dropped.get(r):
                body = f"... ({self.dropped[r]} earlier characters: pool.last.stdout({r}) has them)\n" + body
            if values and values.get(r) is not None:
                body += ("" if not body or body.endswith("\n") else "\n") + f"Out[rank {r}]: {values[r]}\n"
            if body:
                blocks.append(f"[rank {r}]\n{body.rstrip()}")
        return {"text/plain": "\n".join(blocks)}

    def refresh(self, values: dict[int, str] | None = None) -> None:
        from IPython.display import display

        self.last = time.monotonic()
        bundle = self._bundle(values)
        if not bundle["text/plain"]:
            return
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)  # type: ignore[no-untyped-call]
        else:
            self.handle.update(bundle, raw=True)
        self.dirty = False

    def finish(self, values: dict[int, str]) -> None:
        if self.grouped:
            if self.dirty or any(v is not None for v in values.values()):
                self.refresh(values)
            return
        for (rank, stream), rest in sorted(self.partial.items()):
            if rest:
                (sys.stderr if stream == "stderr" else sys.stdout).write(f"[rank {rank}] {rest}\n")
        self.partial.clear()
        for r in sorted(values):
            if values[r] is not None:
                print(f"Out[rank {r}]: {values[r]}")


@magics_class
class PoolMagics(Magics):
    """``%dist_start``, ``%%dist``, ``%dist_push``, ``%dist_pull``, ``%dist_mode``; ``%dist_stop`` ends the pool."""

    runs_dir = traitlets.Unicode("", help="Folder for the pool's run directory (empty: DistMagics.runs_dir).").tag(
        config=True
    )
    start_parser = _start_parser()
    cell_parser = _cell_parser()
    push_parser = _push_parser()
    pull_parser = _pull_parser()
    mode_parser = _mode_parser()

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        self.pool: Any = None
        """The pool started by ``%dist_start`` (``None`` before, and after ``%dist_stop``)."""
        self.mode: str | None = None
        """The ``%%dist`` line every cell gets while ``%dist_mode on`` (``None``: off)."""

    # ---------------------------------------------------------------- helpers
    def _parse(self, parser: MagicArgumentParser, line: str) -> Any:
        return parse_magic_line(parser, line)

    @property
    def _ns(self) -> dict[str, Any]:
        return self.shell.user_ns if self.shell is not None else {}

    def _pool(self) -> Any:
        if self.pool is None or self.pool.state == "stopped":
            raise UsageError("no pool is running: start one with %dist_start --nproc 2")
        return self.pool

    def _runs_dir(self, given: str | None) -> str:
        if given:
            return given
        if self.runs_dir:
            return str(self.runs_dir)
        dist = self.shell.magics_manager.registry.get("DistMagics") if self.shell is not None else None
        return str(getattr(dist, "runs_dir", "runs"))

    # ---------------------------------------------------------------- magics
    @line_magic
    def dist_start(self, line: str) -> Any:
        """Start a pool of ranks that keep their state from cell to cell; ``%%dist`` runs cells on them.

        The ranks are fresh torchrun processes (gloo on CPU, NCCL on GPUs) with the process group initialised and
        ``jd`` bound, as in ``%%dist_train``. Waits until every rank has connected (seconds). ``%dist_stop`` ends
        the pool. ``%dist_start --help`` lists the options.

        Examples
        --------
        ::

            In [1]: %load_ext jupyter_dist
            In [2]: %dist_start --nproc 2
            In [3]: %%dist
               ...: import torch, torch.distributed as dist
               ...: x = torch.ones(3) * (jd.rank + 1)
            In [4]: %%dist
               ...: dist.all_reduce(x); print(x)
            In [5]: %dist_pull x --rank 1
            In [6]: %dist_stop
        """
        args = self._parse(self.start_parser, line)
        if args is None:
            return None
        from ..pool.kernel import Pool

        plan = None
        if args.plan:
            if args.plan not in self._ns:
                raise UsageError(f"--plan {args.plan}: no variable of that name in the notebook")
            plan = self._ns[args.plan]
        if args.name is not None and not args.name.isidentifier():
            raise UsageError(f"--name {args.name!r} must be a valid Python variable name (the Pool is bound to it)")
        env: dict[str, str] = {}
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--env wants NAME=VALUE, got {item!r}")
            env[key] = value
        try:
            pool = Pool(nproc=args.nproc, strategy=args.strategy, plan=plan, env=env,
                        runs_dir=self._runs_dir(args.runs_dir), start_timeout=args.start_timeout,
                        oversubscribe=args.oversubscribe)  # fmt: skip
            if args.dry_run:
                return pool.dry_run()
            if self.pool is not None and self.pool.state != "stopped":
                raise UsageError(f"a pool is already running ({self.pool.state}, {self.pool.world_size} ranks, "
                                 f"{self.pool.dir}): %dist_stop it first")  # fmt: skip
            pool.start()
        except JupyterDistError as exc:
            raise UsageError(str(exc)) from None
        self.pool = pool
        if args.name:
            self._ns[args.name] = pool
        if args.dashboard:
            try:
                pool.dashboard(interval=1.0).show()
            except JupyterDistError as exc:  # e.g. anywidget missing: the pool works without panels
                print(f"(no live panels: {exc})")
        return pool

    @cell_magic
    def dist(self, line: str, cell: str) -> None:
        """Run the cell on every rank of the pool (or ``--ranks 0,1``); each rank keeps its namespace.

        Output streams back live, grouped by rank; the last expression's value is shown per rank. An exception
        shows each failing rank's traceback (the others keep their state). Interrupting the kernel interrupts
        the cell on every rank; ``--timeout S`` interrupts it after S seconds and says where each rank was.

        Examples
        --------
        ::

            In [3]: %%dist --ranks 0 --timeout 60
               ...: print(jd.rank, model)
        """
        args = self._parse(self.cell_parser, line)
        if args is None:
            return None
        from ..pool.results import CellError, PoolError, parse_ranks

        pool = self._pool()
        try:
            ranks = parse_ranks(args.ranks, pool.world_size)
            if args.timeout is not None and not args.timeout > 0:
                raise PoolError(f"--timeout must be positive seconds, got {args.timeout}")
        except PoolError as exc:
            raise UsageError(str(exc)) from None
        live = _LiveOutput(self.shell, ranks)
        try:
            result = pool.execute(cell, ranks=ranks, timeout=args.timeout, on_output=live, on_idle=live.tick)
        except PoolError as exc:  # broken (a rank died): what the ranks printed was shown; say why in one line
            live.finish({})
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            live.finish({})
            raise
        live.finish({r: rep.value for r, rep in result.ranks.items()})
        if result.failed or result.timed_out:
            raise CellError(result)
        return None

    @line_magic
    def dist_push(self, line: str) -> None:
        """Send notebook variables to the ranks: ``%dist_push NAME[,NAME...] [--ranks R]`` (cloudpickle).

        Tensors arrive as CPU tensors (move them with ``.to(jd.device)`` in a cell).
        """
        args = self._parse(self.push_parser, line)
        if args is None:
            return
        from ..pool.results import PoolError, parse_ranks

        pool = self._pool()
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        objects = {}
        for name in names:
            if not name.isidentifier():
                raise UsageError(f"%dist_push: {name!r} is not a variable name")
            if name not in self._ns:
                raise UsageError(f"%dist_push {name}: no variable of that name in the notebook")
            objects[name] = self._ns[name]
        if not objects:
            raise UsageError("usage: %dist_push NAME[,NAME...] [--ranks R]")
        try:
            ranks = parse_ranks(args.ranks, pool.world_size)
            pool.push(objects, ranks=ranks)
        except PoolError as exc:
            raise UsageError(str(exc)) from None
        print(f"pushed {', '.join(names)} to rank(s) {', '.join(map(str, ranks))}")

    @line_magic
    def dist_pull(self, line: str) -> None:
        """Fetch a variable from the ranks into the notebook: ``%dist_pull NAME [--rank K | --all] [--gather]``.

        Binds ``NAME`` (or ``--as VAR``) in the notebook. Tensors come back as CPU tensors; a DTensor comes back as
        the rank's local shard, or whole with ``--gather``; ``--all`` gives ``{rank: value}``.
        """
        args = self._parse(self.pull_parser, line)
        if args is None:
            return
        from ..pool.results import PoolError

        pool = self._pool()
        if not args.name.isidentifier():
            raise UsageError(f"%dist_pull: {args.name!r} is not a variable name")
        target = args.as_ or args.name
        if not target.isidentifier():
            raise UsageError(f"--as {target!r} must be a valid Python variable name")
        if args.all and args.rank is not None:
            raise UsageError("%dist_pull: use --rank K or --all, not both")
        try:
            if args.all:
                value = pool.pull_all(args.name, gather=args.gather)
                what = ", ".join(f"rank {r}: {_describe(v)}" for r, v in value.items())
            else:
                value = pool.pull(args.name, rank=0 if args.rank is None else args.rank, gather=args.gather)
                what = _describe(value)
        except PoolError as exc:
            raise UsageError(str(exc)) from None
        self._ns[target] = value
        print(f"{target} = {what}")

    @line_magic
    def dist_mode(self, line: str) -> None:
        """``%dist_mode on``: every following cell runs on the pool as if it began with ``%%dist``; ``off``: locally.

        Cells whose first line starts with ``%`` or ``!`` (magics such as ``%dist_mode off``, ``%dist_pull``) still
        run in the notebook. ``--ranks`` and ``--timeout`` apply to every pool cell. ``%dist_stop`` turns it off.
        """
        args = self._parse(self.mode_parser, line)
        if args is None:
            return
        if args.state is None:
            print(f"dist mode: {'on (%%dist ' + self.mode + ')' if self.mode is not None else 'off'}")
            return
        state = args.state.strip().lower()
        if state not in ("on", "off"):
            raise UsageError(f"%dist_mode {args.state}: want on or off")
        if state == "off":
            self.set_mode(None)
            print("dist mode off: cells run in the notebook")
            return
        pool = self._pool()
        opts = []
        if args.ranks is not None:
            from ..pool.results import PoolError, parse_ranks

            try:
                parse_ranks(args.ranks, pool.world_size)
            except PoolError as exc:
                raise UsageError(str(exc)) from None
            opts += ["--ranks", args.ranks]
        if args.timeout is not None:
            if not args.timeout > 0:
                raise UsageError(f"--timeout must be positive seconds, got {args.timeout}")
            opts += ["--timeout", repr(args.timeout)]
        self.set_mode(shlex.join(opts))
        print(f"dist mode on: cells run on the pool's {pool.world_size} ranks (%dist_mode off to stop)")

    # ---------------------------------------------------------------- mode
    def set_mode(self, options: str | None) -> None:
        """Turn the mode on (``options``: the ``%%dist`` flags) or off (``None``)."""
        transformers = self.shell.input_transformers_cleanup if self.shell is not None else []
        if options is None:
            while self._transform in transformers:
                transformers.remove(self._transform)
        elif self._transform not in transformers:
            transformers.append(self._transform)
        self.mode = options

    def _transform(self, lines: list[str]) -> list[str]:
        """Input transformer: prefix ``%%dist`` to a cell, unless it starts with a magic or a shell escape."""
        if self.mode is None:
            return lines
        first = next((ln for ln in lines if ln.strip()), None)
        if first is None or first.lstrip().startswith(("%", "!")):
            return lines
        return [f"%%dist {self.mode}".rstrip() + "\n", *lines]

    def stop_pool(self) -> Any:
        """End the pool (no process is left), turn the mode off; returns the stopped pool."""
        pool = self._pool()
        self.set_mode(None)
        pool.stop()
        return pool


_registered: dict[int, PoolMagics] = {}


def register(ipython: Any) -> None:
    """Register :class:`PoolMagics` (called by ``load_ipython_extension``)."""
    magics = PoolMagics(ipython)
    ipython.register_magics(magics)
    _registered[id(ipython)] = magics


def unregister(ipython: Any) -> None:
    """Remove the pool magics and the dist-mode transformer (the pool itself keeps running until stopped)."""
    magics = _registered.pop(id(ipython), None)
    if magics is None:
        return
    magics.set_mode(None)
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)


def route_stop(shell: Any, line: str, last_run: Any) -> Any:
    """``%dist_stop`` for the pool: ``--pool``, or no argument while a pool runs and no run does.

    Returns the stopped pool, or ``None`` when the line is about a run (the caller stops it). With no argument while
    both a pool and a run are live, a UsageError asks which.
    """
    magics = _registered.get(id(shell)) if shell is not None else None
    arg = line.strip()
    pool = magics.pool if magics is not None else None
    live_pool = pool is not None and pool.state != "stopped"
    if arg == "--pool":
        if not live_pool:
            raise UsageError("%dist_stop --pool: no pool is running")
        assert magics is not None
        return magics.stop_pool()
    if arg or not live_pool:
        return None
    if last_run is not None and not last_run.done:
        raise UsageError(f"both a pool and run {last_run.name} are running: %dist_stop --pool ends the pool, "
                         "%dist_stop NAME ends the run bound to NAME")  # fmt: skip
    assert magics is not None
    return magics.stop_pool()
