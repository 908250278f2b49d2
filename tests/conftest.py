"""Shared fixtures; the browser ones (``jupyterlab``, ``chromium``, ``browser_page``, ``artifacts``) wrap browser.py."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, JupyterLabServer, artifact_dir, kill_procs, require_browser
from scheduling import make_scheduler
from slurm_cluster import slurm_cluster  # noqa: F401 - the session-scoped real SLURM cluster fixture

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from playwright.sync_api import Browser, Page

    from jupyter_dist.launch.run import Run


BIN = os.path.dirname(sys.executable)
"""The interpreter's bin folder: first on the suite's PATH, as an activated venv has it (scripts/test.sh sources
``activate``; ``/path/to/.venv/bin/python -m pytest`` does not). Every process of the suite (the ``deepspeed_ops``
build, torchrun's ranks, generated scripts) then finds the same ``ninja``: pip's (1.13, a DeepSpeed dependency) and
Debian's (1.11) hash build commands differently in ``.ninja_log``, so an op built by one was rebuilt by the other at
each switch (seen: ``deepspeed_shm_comm`` built five times in one run, two minutes each under load)."""
if os.environ.get("PATH", "").split(os.pathsep)[0] != BIN:
    os.environ["PATH"] = BIN + os.pathsep + os.environ.get("PATH", "")

SUITE_THREADS = os.environ.setdefault("OMP_NUM_THREADS", "1")
"""torch's intra-op threads in every process of the suite (the workers, kernels, one-process references, rehearsed
ranks; torchrun gives its ranks 1 already): the suite runs two workers and their launches on 2 cores, and a process
with 2 OpenMP threads on a busy machine spins at each parallel region's barrier while its other thread waits for a
core. Measured on 2 cores kept busy by two other processes (``yes``): ``tests/test_memory_measured.py`` and
``tests/test_model.py`` (in-process torch) 124 -> 87 CPU-s, 142 -> 91 s, with 1 thread. A value set before the suite
starts is kept."""
if "torch" in sys.modules:  # imported before this file (a plugin): its pool is already sized
    sys.modules["torch"].set_num_threads(int(SUITE_THREADS))

DS_EXTENSIONS = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                                          str(Path.home() / ".cache" / "jupyter-dist" / "torch_extensions")))
"""Where every test and every rank it starts builds and loads DeepSpeed's C++ ops: one folder for the suite."""


DS_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")
"""DeepSpeed's CPU ops the suite's runs load: ``deepspeed_shm_comm`` (``deepspeed.initialize``), ``fused_adam`` (a
ZeRO run's Adam without offload) and ``cpu_adam`` (offload)."""
DS_OP_FOLDERS = ("deepspeed_shm_comm", "fused_adam", "cpu_adam")
"""Their folders (and ``.so`` names) under ``TORCH_EXTENSIONS_DIR``."""
_DS_BUILD = ("import sys\nfrom deepspeed.accelerator import get_accelerator\n"
             "for name in sys.argv[1:]:\n    get_accelerator().create_op_builder(name).load()\n")  # fmt: skip
_EARLY_BUILDS: list[Any] = []


_NO_DEBUG_INFO = """#!/bin/sh
# The C++ compiler of the test suite's DeepSpeed op builds (tests/conftest.py): the real one without -g.
for a do
    shift
    [ "$a" = -g ] || set -- "$@" "$a"
done
exec {real} "$@"
"""


def compiler_without_debug_info() -> Path | None:
    """A folder holding a ``c++`` that runs the real one with ``-g`` dropped, put first on PATH by the suite's op
    builds (``None`` without a ``c++``). DeepSpeed compiles each op with ``-O3 -g``; the debug info is ~30 % of a
    compile (``cpu_adam.cpp``: 51 -> 36 CPU-s) and nothing in the suite reads it. The build command ninja records
    stays ``c++ ... -g ...`` word for word, so a process that loads the ops later with the plain compiler on its PATH
    (a rank, a SLURM or SkyPilot job) finds them up to date: changing ``CXX`` or DeepSpeed's flags instead would make
    it rebuild them. The folder's name has ``g++`` in it, which is how torch accepts a compiler by its path."""
    import shlex
    import shutil
    import tempfile

    real = shutil.which("c++")
    if real is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"jupyter-dist-g++-without-debug-info-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    script, text = folder / "c++", _NO_DEBUG_INFO.format(real=shlex.quote(real))
    if not script.exists() or script.read_text() != text:
        part = folder / f".c++.{os.getpid()}"
        part.write_text(text)
        part.chmod(0o755)
        os.replace(part, script)  # the controller and both workers may write it at once
    return folder


def build_deepspeed_ops(*, apart: bool, wait: bool) -> list[Any]:
    """Build (or load, once built) :data:`DS_OPS`: ``apart``, each in its own process, all at once (one op's build is
    one or two compiler processes, so one after the other they left a core idle; ~5 CPU-minutes in all on 2 cores,
    most of it compiling torch's headers, less without debug info: :func:`compiler_without_debug_info`), else one
    process loading them in turn (6 CPU-seconds of ``import deepspeed`` when they are built). A process that finds
    another building an op waits on torch's build lock and loads it. Returns the processes (finished when ``wait``;
    a failure's output is in the assertion)."""
    import subprocess
    import tempfile

    DS_EXTENSIONS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(DS_EXTENSIONS))
    fast = compiler_without_debug_info()
    if fast is not None:
        env["PATH"] = f"{fast}{os.pathsep}{env.get('PATH', '')}"
    procs = []
    for names in ([[n] for n in DS_OPS] if apart else [list(DS_OPS)]):
        out = tempfile.TemporaryFile()  # noqa: SIM115 - read after the process ends, closed with it
        proc = subprocess.Popen([sys.executable, "-c", _DS_BUILD, *names], env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        proc.output_file = out  # type: ignore[attr-defined]
        procs.append(proc)
    if wait:
        for proc in procs:
            try:
                proc.wait(timeout=1200)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.output_file.seek(0)
            text = proc.output_file.read().decode(errors="replace")
            proc.output_file.close()
            assert proc.returncode == 0, f"building DeepSpeed's ops {proc.args[3:]} failed:\n" + text[-4000:]
    return procs


def pytest_sessionstart(session: pytest.Session) -> None:
    """The controller of a run that selects slow tests starts DeepSpeed's op builds at once, so that they overlap
    the workers' start and collection instead of holding the first slow test of each worker."""
    import importlib.util

    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # a worker, or no xdist: the fixture builds when a slow test asks
    if "not slow" in (config.getoption("markexpr", "") or "") or config.getoption("collectonly", False):
        return
    built = all((DS_EXTENSIONS / op / f"{op}.so").exists() for op in DS_OP_FOLDERS)
    if not built and importlib.util.find_spec("deepspeed") is not None:
        _EARLY_BUILDS.extend(build_deepspeed_ops(apart=True, wait=False))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Never leave a build behind (killing one would leave torch's build lock for the next run: wait instead)."""
    for proc in _EARLY_BUILDS:
        proc.wait()
        proc.output_file.close()


@pytest.fixture(scope="session")
def deepspeed_ops() -> Path | None:
    """DeepSpeed's CPU ops (:data:`DS_OPS`) built once before each worker's first slow test, outside every run's
    time budget: on a fresh machine each build takes 1-2 CPU-minutes, and inside a run it ate the run's start limit.
    The controller started the builds already (``pytest_sessionstart``); here each worker waits for them (torch's
    build lock) or builds what is missing. ``None`` without DeepSpeed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    build_deepspeed_ops(apart=False, wait=True)
    return DS_EXTENSIONS


@pytest.fixture(autouse=True)
def _deepspeed_ops_before_slow_tests(request: pytest.FixtureRequest) -> None:
    """Every slow test (real runs, notebooks, clusters) starts with DeepSpeed's ops built (see ``deepspeed_ops``)."""
    if request.node.get_closest_marker("slow") is not None:
        request.getfixturevalue("deepspeed_ops")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Keep each phase's report on the item (``item.rep_call``) so fixtures can tell whether the test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    """With ``JD_TEST_CPU=FILE``: append one JSON line per test to FILE, its wall seconds and the CPU seconds of this
    process and the children it reaped meanwhile (torchrun and its ranks, kernels; not daemons that outlive the test,
    such as SkyPilot's API server). Setup of module fixtures counts to the module's first test, as in --durations.
    ``python scripts/durations.py --cpu FILE`` sums it per file."""
    path = os.environ.get("JD_TEST_CPU")
    if not path:
        return (yield)
    import json
    import resource

    def cpu() -> float:
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))  # fmt: skip

    t0, c0 = time.monotonic(), cpu()
    try:
        return (yield)
    finally:
        line = {"test": item.nodeid, "wall": round(time.monotonic() - t0, 2), "cpu": round(cpu() - c0, 2),
                "end": round(time.time(), 1), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(path, "a", encoding="utf-8") as fh:  # one short append per line: the workers' lines never mix
            fh.write(json.dumps(line) + "\n")


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLabServer]:
    """A JupyterLab server (one per test module) serving a fresh temporary directory: ``jupyterlab.root_dir``."""
    require_browser()
    with JupyterLabServer(tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Headless Chromium (Debian's binary) driven by Playwright, one per test module."""
    require_browser()
    from playwright.sync_api import sync_playwright

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield browser
        finally:
            browser.close()
    finally:
        pw.stop()
        # the Playwright driver and Chromium exit on their own; kill whatever of theirs did not
        kill_procs(p for p in psutil.Process().children(recursive=True) if p.pid not in before)


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    """``test-artifacts/<test id>/``: where a test saves screenshots and other evidence."""
    return artifact_dir(request.node.nodeid.split("::", 1)[-1])


@pytest.fixture
def browser_page(request: pytest.FixtureRequest, chromium: Browser) -> Iterator[Page]:
    """A fresh page (own context, 1280×900) in ``chromium``; default timeout 30 s.

    The page's console messages and errors are collected in ``page.jd_console``. When the test fails, a screenshot,
    the console log and (if the test uses ``jupyterlab``) the server log tail are saved to ``test-artifacts/<test>/``.
    After the test the page is closed and, if the test uses ``jupyterlab``, all its sessions are shut down.
    """
    context = chromium.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"[{msg.type}] {msg.text}"))
    page.on("pageerror", lambda err: console.append(f"[pageerror] {err}"))
    page.jd_console = console  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        rep = getattr(request.node, "rep_call", None)
        server = _server_of(request)
        if rep is not None and rep.failed:
            out = artifact_dir(request.node.nodeid.split("::", 1)[-1])
            try:
                page.screenshot(path=str(out / "failure.png"))
            except Exception as err:  # the page may be gone; the logs matter more
                console.append(f"(failure screenshot not taken: {err})")
            (out / "console.log").write_text("\n".join(console) + "\n")
            if server is not None:
                (out / "server.log").write_text(server.log_tail(400) + "\n")
        context.close()
        if server is not None and server.proc is not None:
            server.delete_sessions()


def _server_of(request: pytest.FixtureRequest) -> JupyterLabServer | None:
    """The test's ``jupyterlab`` server, if it uses one that started."""
    if "jupyterlab" not in request.fixturenames:
        return None
    try:
        return request.getfixturevalue("jupyterlab")  # type: ignore[no-any-return]
    except (Exception, pytest.skip.Exception, pytest.fail.Exception):  # its set-up failed: reported already
        return None


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N``: whole files, the longest first (tests/scheduling.py)."""
    return make_scheduler(config, log)


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say whether browser tests must run (CI) or may skip."""
    lines = []
    if os.environ.get("JD_REQUIRE_BROWSER", "") not in ("", "0"):
        lines.append(f"browser tests required (JD_REQUIRE_BROWSER); Chromium: {CHROMIUM}")
    if os.environ.get("JD_REQUIRE_SLURM", "") not in ("", "0"):
        lines.append("SLURM tests required (JD_REQUIRE_SLURM): a real cluster is started on this machine")
    return "\n".join(lines) or None


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hardware calibrations (``%dist_tune``) go to a fresh folder per test, never the user's cache."""
    folder = tmp_path_factory.mktemp("calibration")
    monkeypatch.setenv("JD_CALIBRATION_DIR", str(folder))
    return folder


# ----------------------------------------------------------------------------------------- magics and real runs
@pytest.fixture(scope="module")
def ip() -> InteractiveShell:
    """A real IPython shell with the extension loaded (one per test module)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_dist")
    return shell


@pytest.fixture()
def runs(tmp_path: Path, ip: InteractiveShell) -> Path:
    """Run directories of the magics go to this test's temporary folder."""
    ip.config.DistMagics.runs_dir = str(tmp_path)
    ip.magics_manager.registry["DistMagics"].runs_dir = str(tmp_path)
    return tmp_path


def run_processes(run: Run) -> list[psutil.Process]:
    """Every live process started for ``run`` (they all inherit its JD_RUN_DIR)."""
    found = []
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            env = proc.info["environ"] or {}
            if env.get("JD_RUN_DIR") == str(run.dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def descendants_gone(run: Run, within: float = 10.0) -> bool:
    """Whether every process of ``run`` (launchers and ranks) is gone within ``within`` seconds."""
    deadline = time.time() + within
    while time.time() < deadline:
        if not run_processes(run):
            return True
        time.sleep(0.2)
    return False


def wait_until(check: Any, timeout: float, what: str, *, poll: float = 0.1) -> None:
    """Poll ``check()`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(poll)
    raise AssertionError(f"{what} within {timeout} s")


CLUSTER_TRAIN = """import time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = jd.wrap(model, opt)
g = torch.Generator().manual_seed(jd.rank)
X = torch.randn(256, 16, generator=g)
y = X.sum(1, keepdim=True)
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(model(X), y)
    jd.backward(loss)
    jd.step(opt)
    jd.log(step, loss=loss)
    time.sleep(PAUSE)
print("final loss", float(loss), "on", jd.world_size, "ranks with", type(model).__name__)
"""


def cluster_train(steps: int = 25, pause: float = 0.0) -> str:
    """The training cell of the cluster back-end tests (SLURM, SkyPilot): ``steps`` steps, ``pause`` s each."""
    return CLUSTER_TRAIN.replace("STEPS", str(steps)).replace("PAUSE", str(pause))
