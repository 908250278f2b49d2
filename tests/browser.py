"""Real-browser test infrastructure: a throw-away JupyterLab server driven by headless Chromium through Playwright.

The fixtures that use this module live in ``conftest.py`` (``jupyterlab``, ``chromium``, ``browser_page``,
``artifacts``). A typical test::

    @pytest.mark.browser
    @pytest.mark.slow
    def test_thing(jupyterlab, browser_page, artifacts):
        write_notebook(jupyterlab.root_dir / "t.ipynb", ["import ipywidgets as w; w.IntSlider(value=3)"])
        open_notebook_and_run_all(browser_page, jupyterlab, "t.ipynb")
        expect(browser_page.locator(".widget-slider")).to_be_visible()
        screenshot_cell(browser_page, 0, artifacts / "slider.png")

Everything here talks to JupyterLab through ``window.jupyterapp`` (the server runs with
``--LabApp.expose_app_in_browser=True``) rather than through CSS selectors of JupyterLab's own UI, which change
between versions. Every process started here is stopped with all its descendants.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
"""Screenshots and failure logs of browser tests (git-ignored)."""

CHROMIUM = Path(os.environ.get("JD_CHROMIUM", "/usr/lib/chromium/chromium"))
"""The real Chromium binary from Debian's ``chromium`` package (``/usr/bin/chromium`` is a shell wrapper)."""

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 900}

DEFAULT_LAB_SETTINGS: dict[str, dict[str, Any]] = {
    # no "Would you like to receive official Jupyter news?" toast, no update check (and no network request)
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}
"""JupyterLab settings overrides (``overrides.json``) every test server starts with."""


# --------------------------------------------------------------------------------------------------- availability
def browser_unavailable_reason() -> str | None:
    """Why browser tests cannot run here, or None when Chromium, Playwright and JupyterLab are all present."""
    if not CHROMIUM.exists():
        return f"Chromium not found at {CHROMIUM} (apt-get install chromium chromium-driver)"
    missing = [m for m in ("playwright", "jupyterlab", "nbformat") if not _importable(m)]
    if missing:
        return f"{', '.join(missing)} not installed (pip install -e '.[test]')"
    return None


def require_browser() -> None:
    """Skip the calling test when no browser can run, or fail it when ``JD_REQUIRE_BROWSER`` is set (CI sets it)."""
    reason = browser_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("JD_REQUIRE_BROWSER", "") not in ("", "0"):
        pytest.fail(f"JD_REQUIRE_BROWSER is set but browser tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ------------------------------------------------------------------------------------------------------ processes
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_tree(pid: int, *, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop ``pid`` and every descendant: ``sig`` to the root first, then SIGKILL to whatever outlives ``timeout``.

    The root gets the first chance on its own so that a server can shut its kernels down cleanly; descendants it
    leaves behind (or that were re-parented away from it) are killed afterwards.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    try:
        root.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
    psutil.wait_procs([root], timeout=timeout)
    kill_procs(procs, timeout=timeout)


def kill_procs(procs: Iterable[psutil.Process], *, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``procs`` that is still alive, and reap it."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
            alive.append(p)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM the child if the test process dies without tearing it down (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------------- the server
class JupyterLabServer:
    """A JupyterLab server on 127.0.0.1, isolated from the user's Jupyter configuration, settings and workspaces.

    Use as a context manager (``with JupyterLabServer(tmp) as lab: page.goto(lab.url("lab"))``) or call
    :meth:`start` / :meth:`stop`. ``settings`` are JupyterLab settings overrides merged over
    :data:`DEFAULT_LAB_SETTINGS`, e.g. ``{"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}}``.
    """

    def __init__(self, root_dir: str | os.PathLike[str], *, settings: dict[str, dict[str, Any]] | None = None,
                 startup_timeout: float = 60.0, extra_args: Sequence[str] = ()) -> None:  # fmt: skip
        self.root_dir = Path(root_dir).resolve()
        self.settings = {k: dict(v) for k, v in DEFAULT_LAB_SETTINGS.items()}
        for plugin, values in (settings or {}).items():
            self.settings.setdefault(plugin, {}).update(values)
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self.token = secrets.token_hex(16)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.state_dir: Path | None = None
        self._log_file: Any = None

    # -- lifecycle
    def __enter__(self) -> JupyterLabServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def args(self) -> list[str]:
        """The server's argv (after :meth:`start` has picked the port)."""
        return [
            sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
            f"--port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root_dir}", "--LabApp.expose_app_in_browser=True",
            f"--LabApp.app_settings_dir={self._dir('app-settings')}", *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """The server's environment: the current one with every Jupyter/IPython state dir moved into a temp dir."""
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "JUPYTER_CONFIG_DIR": str(self._dir("config")),
            "JUPYTER_DATA_DIR": str(self._dir("data")),
            "JUPYTER_RUNTIME_DIR": str(self._dir("runtime")),
            "JUPYTERLAB_SETTINGS_DIR": str(self._dir("user-settings")),
            "JUPYTERLAB_WORKSPACES_DIR": str(self._dir("workspaces")),
            "IPYTHONDIR": str(self._dir("ipython")),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> None:
        """Start the server and wait until ``/api`` answers (up to ``startup_timeout`` seconds)."""
        if self.proc is not None:
            raise RuntimeError("JupyterLabServer already started")
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = Path(tempfile.mkdtemp(prefix="jd-lab-"))
        (self._dir("app-settings") / "overrides.json").write_text(json.dumps(self.settings, indent=1))
        for attempt in range(3):  # the free port may be taken between free_port() and the server's bind
            self.port = free_port()
            self._log_file = open(self.log_path, "ab")  # closed in _stop_process()
            self.proc = subprocess.Popen(self.args(), env=self.env(), cwd=self.root_dir, stdin=subprocess.DEVNULL,
                                         stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)  # fmt: skip
            try:
                self._wait_ready()
                return
            except _PortTaken:
                self._stop_process()
                if attempt == 2:
                    break
            except BaseException:
                self.stop()
                raise
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"JupyterLab could not bind a free port after 3 tries. Server log tail:\n{tail}")

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail.lower() or "is already in use" in tail.lower():
                    raise _PortTaken
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode} during start-up "
                                   f"({' '.join(self.args())}). Server log tail:\n{tail}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{self.base_url}/api", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"JupyterLab did not answer {self.base_url}/api within {self.startup_timeout:.0f} s. "
                           f"Server log tail:\n{self.log_tail()}")  # fmt: skip

    def stop(self) -> None:
        """Stop the server with its kernels and whatever else it started, then remove its state directory."""
        self._stop_process()
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None

    def _stop_process(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid, timeout=10)
            self.proc.wait(timeout=10)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- helpers
    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (no token)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr."""
        return self._dir(".") / "server.log"

    def url(self, path: str = "lab", **query: str) -> str:
        """An URL into the server with the token (and ``query``) attached, e.g. ``url("lab/tree/a.ipynb")``."""
        quoted = urllib.parse.quote(path.lstrip("/"), safe="/")
        return f"{self.base_url}/{quoted}?{urllib.parse.urlencode({**query, 'token': self.token})}"

    def notebook_url(self, nb_name: str) -> str:
        """The URL that opens ``nb_name`` (relative to ``root_dir``) in a fresh workspace."""
        return self.url(f"lab/tree/{nb_name}", reset="")

    def api(self, method: str, path: str, body: Any = None, *, timeout: float = 30.0) -> Any:
        """Call the REST API (``api("GET", "sessions")``) and return the decoded JSON (None for empty answers)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}/api/{path.lstrip('/')}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def delete_sessions(self) -> None:
        """Shut down every session (and its kernel) so the next test starts clean."""
        for session in self.api("GET", "sessions"):
            try:
                self.api("DELETE", f"sessions/{session['id']}")
            except urllib.error.HTTPError as err:  # already gone
                if err.code != 404:
                    raise

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, RuntimeError):
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def _dir(self, name: str) -> Path:
        if self.state_dir is None:
            raise RuntimeError("JupyterLabServer is not started")
        path = self.state_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class _PortTaken(Exception):
    pass


# --------------------------------------------------------------------------------------------------- notebooks
def write_notebook(path: str | os.PathLike[str], cells: Sequence[str | Any]) -> Path:
    """Write a notebook with the ``python3`` kernelspec (so JupyterLab starts a kernel without asking).

    ``cells`` are code sources, or ready ``nbformat`` cells (e.g. ``nbformat.v4.new_markdown_cell("# x")``).
    """
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) if isinstance(c, str) else c for c in cells]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


# JS run in the page. `panel(path)` finds the notebook panel of a document (or the current widget).
_PANEL_JS = """
const panel = (path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  if (!path) return app.shell.currentWidget;
  for (const w of app.shell.widgets('main')) { if (w.context && w.context.path === path) return w; }
  return null;
};
"""


def _js(body: str) -> str:
    """A page function ``(arg) => {...}`` with ``panel(path)`` in scope."""
    return f"(arg) => {{ {_PANEL_JS} {body} }}"


def _wait(page: Page, body: str, arg: Any, timeout: float, what: str) -> Any:
    """``page.wait_for_function`` with a message that says what was awaited and what the notebook looked like."""
    __tracebackhide__ = True
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    try:
        return page.wait_for_function(_js(body), arg=arg, timeout=timeout * 1000, polling=100)
    except PlaywrightTimeoutError:
        state = page.evaluate(_js("""
          const p = panel(arg.path);
          const k = p && p.sessionContext && p.sessionContext.session && p.sessionContext.session.kernel;
          return {app: !!window.jupyterapp, panel: p ? p.id : null, kernel: k ? k.status : null,
                  dialogs: [...document.querySelectorAll('.jp-Dialog')].map(d => d.innerText.slice(0, 200))};
        """), {"path": arg.get("path") if isinstance(arg, dict) else None})  # fmt: skip
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; page state: {state}") from None


def wait_for_notebook(page: Page, nb_name: str | None = None, timeout: float = 60.0) -> None:
    """Wait until the notebook ``nb_name`` (default: the current widget) is open and its document is loaded."""
    __tracebackhide__ = True
    ready = "const p = panel(arg.path); return !!(p && p.content && p.context?.isReady && p.sessionContext);"
    _wait(page, ready, {"path": nb_name}, timeout, f"notebook {nb_name or '(current)'} to open")


def wait_for_kernel_idle(page: Page, nb_name: str | None = None, timeout: float = 60.0) -> None:
    """Wait until the kernel of notebook ``nb_name`` (default: the current widget) reports ``idle``."""
    __tracebackhide__ = True
    _wait(page, "const p = panel(arg.path); const s = p && p.sessionContext && p.sessionContext.session; "
          "return !!(s && s.kernel && s.kernel.status === 'idle');", {"path": nb_name}, timeout,
          f"the kernel of {nb_name or 'the current notebook'} to be idle")  # fmt: skip


def open_notebook(page: Page, server: JupyterLabServer, nb_name: str, timeout: float = 60.0) -> None:
    """Navigate to ``nb_name`` (relative to the server's root) and wait until it is shown with an idle kernel."""
    __tracebackhide__ = True
    page.goto(server.notebook_url(nb_name), timeout=timeout * 1000)
    wait_for_notebook(page, nb_name, timeout)
    wait_for_kernel_idle(page, nb_name, timeout)


def run_all_cells(page: Page, nb_name: str | None = None, timeout: float = 120.0, *,
                  raise_on_error: bool = True) -> list[str]:  # fmt: skip
    """Run every cell (``notebook:run-all-cells``), wait until all ran and the kernel is idle again.

    Returns the cells' errors as ``"cell <i>: <ename>: <evalue>"``; raises AssertionError on any unless
    ``raise_on_error`` is False.
    """
    __tracebackhide__ = True
    page.evaluate(_js("""
      const p = panel(arg.path);
      window.jupyterapp.shell.activateById(p.id);
      window.__jdRunAll = {done: false};
      window.jupyterapp.commands.execute('notebook:run-all-cells').then(
        (ok) => { window.__jdRunAll = {done: true, ok}; },
        (err) => { window.__jdRunAll = {done: true, error: String(err)}; });
    """), {"path": nb_name})  # fmt: skip
    _wait(page, "return !!(window.__jdRunAll && window.__jdRunAll.done);", {"path": nb_name}, timeout,
          "notebook:run-all-cells to finish")  # fmt: skip
    wait_for_kernel_idle(page, nb_name, timeout)
    result = page.evaluate("() => window.__jdRunAll")
    if result.get("error"):
        raise AssertionError(f"notebook:run-all-cells failed: {result['error']}")
    errors: list[str] = page.evaluate(_js("""
      const p = panel(arg.path), out = [];
      const cells = p.content.model.cells;
      for (let i = 0; i < cells.length; i++) {
        const c = cells.get(i);
        if (c.type !== 'code') continue;
        for (const o of c.outputs.toJSON()) {
          if (o.output_type === 'error') out.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
        }
      }
      return out;
    """), {"path": nb_name})  # fmt: skip
    if errors and raise_on_error:
        raise AssertionError("cells raised:\n" + "\n".join(errors))
    return errors


def open_notebook_and_run_all(page: Page, server: JupyterLabServer, nb_name: str, timeout: float = 120.0) -> None:
    """Open ``nb_name`` in JupyterLab, wait for an idle kernel, run all cells and wait until they finished.

    Raises AssertionError naming the cell if any cell raised.
    """
    __tracebackhide__ = True
    open_notebook(page, server, nb_name, timeout=min(timeout, 60.0))
    run_all_cells(page, nb_name, timeout)


# ---------------------------------------------------------------------------------------------------- cells
def cell_locator(page: Page, cell_index: int, nb_name: str | None = None) -> Locator:
    """A Playwright locator for cell ``cell_index`` of the notebook, scrolled into view so it is rendered.

    JupyterLab renders only the cells near the viewport (windowing), so this scrolls the notebook first and
    marks the cell's node with ``data-jd-cell``.
    """
    _wait(page, """
      const p = panel(arg.path);
      if (!p || !p.content || arg.index >= p.content.widgets.length) return false;
      const nb = p.content;
      if (!window.__jdScrolled || window.__jdScrolled.key !== p.id + ':' + arg.index) {
        window.__jdScrolled = {key: p.id + ':' + arg.index};
        nb.activeCellIndex = arg.index;
        Promise.resolve(nb.scrollToItem(arg.index, 'start')).catch(() => {});
      }
      const node = nb.widgets[arg.index].node;
      if (!node.isConnected) return false;
      node.setAttribute('data-jd-cell', p.id + '-' + arg.index);
      return true;
    """, {"path": nb_name, "index": cell_index}, 30.0, f"cell {cell_index} to be attached")  # fmt: skip
    marker = page.evaluate(_js("const p = panel(arg.path); return p.id + '-' + arg.index;"),
                           {"path": nb_name, "index": cell_index})  # fmt: skip
    page.evaluate("() => { window.__jdScrolled = null; }")
    locator = page.locator(f'[data-jd-cell="{marker}"]')
    locator.scroll_into_view_if_needed()
    return locator


def screenshot_cell(page: Page, cell_index: int, path: str | os.PathLike[str], nb_name: str | None = None) -> Path:
    """Scroll cell ``cell_index`` into view and save a PNG of just that cell to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cell_locator(page, cell_index, nb_name).screenshot(path=str(path), animations="disabled")
    return path


# ------------------------------------------------------------------------------------------------- artifacts
def artifact_dir(name: str) -> Path:
    """``test-artifacts/<name>`` (created), with ``name`` made safe for a file system (e.g. a pytest node id)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_")[:150]
    path = ARTIFACTS / safe
    path.mkdir(parents=True, exist_ok=True)
    return path
