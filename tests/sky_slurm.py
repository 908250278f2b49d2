"""SkyPilot on the local SLURM cluster: a real multi-node SkyPilot cluster without any cloud (docs/recipes.md).

On top of :class:`slurm_cluster.SlurmCluster`:

1. an unprivileged job user (``jdsky``; ``usermod -p '*'`` since sshd refuses a locked account);
2. ``sshd`` on 127.0.0.1 at a free port as the "login node" (own config, host key, pid file and authorized keys in a
   temporary folder; ``UsePAM no``, ``StrictModes no``; ``SetEnv SLURM_CONF=... SSL_CERT_FILE=...``);
3. ``~/.slurm/config`` on the client naming that login node, then ``sky check slurm``;
4. before each launch, :meth:`SkySlurm.seed` puts what SkyPilot's runtime set-up would download in place: the
   ``uv`` binary at ``<cluster home>/.local/bin/uv``, ``system-certs = true`` in its ``uv.toml``, and the runtime
   venv made with ``uv venv --seed <runtime dir>/skypilot-runtime --python /usr/bin/python3``.

Jobs run as the job user, so the training Python (this venv) and jupyter_dist must be readable by it.

``~/.slurm/config`` and the SkyPilot API server are per machine user, not per test session: two test sessions on one
machine would rewrite each other's login node and take down each other's clusters. :meth:`SkySlurm.start` therefore
holds an exclusive lock (``/tmp/jupyter-dist-skypilot-tests.lock``) until :meth:`SkySlurm.stop`; a second session
waits for it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slurm_cluster import SlurmCluster, _free_port

USER = "jdsky"
ALIAS = "jdlocal"
CERTS = "/etc/ssl/certs/ca-certificates.crt"
LOCK = "/tmp/jupyter-dist-skypilot-tests.lock"


def _uv() -> str | None:
    return shutil.which("uv") or next((str(p) for p in (Path(sys.executable).parent / "uv",) if p.exists()), None)


def user_processes(user: str) -> list[Any]:
    """Live processes of ``user``."""
    import psutil

    out = []
    for proc in psutil.process_iter(["username", "status"]):
        try:
            if proc.info["username"] == user and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def kill_user_processes(user: str) -> list[int]:
    """SIGKILL each live process of ``user``, by PID; returns the PIDs."""
    import psutil

    procs = user_processes(user)
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)
    return [p.pid for p in procs]


def _api_server_running() -> bool:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "sky.server.server" in " ".join(proc.info["cmdline"] or []):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


class SkySlurm:
    """sshd + job user + ``~/.slurm/config`` + ``sky check slurm`` for a running :class:`SlurmCluster`."""

    def __init__(self, slurm: SlurmCluster) -> None:
        self.slurm = slurm
        self.root: Path | None = None
        self.sshd: subprocess.Popen[bytes] | None = None
        self.home = ""
        self._slurm_config_backup: bytes | None = None
        self._created_config = False
        self._granted: dict[Path, int] = {}

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why SkyPilot-on-SLURM cannot run here, or None."""
        reason = SlurmCluster.unavailable_reason()
        if reason:
            return reason
        tools = ("sshd", "rsync", "ssh-keygen", "useradd")
        missing = [n for n in tools if not (shutil.which(n) or os.path.exists(f"/usr/sbin/{n}"))]
        if missing:
            return f"{', '.join(missing)} missing: apt-get install openssh-server rsync"
        if _uv() is None:
            return "no uv binary (pip install uv): SkyPilot's runtime set-up would download it"
        try:
            import sky  # noqa: F401
        except ImportError:
            return 'SkyPilot is not installed: pip install "jupyter-dist[sky]"'
        return None

    def start(self, lock_timeout: float = 900.0) -> None:
        """Take the machine-wide lock, create the user, start sshd, write ``~/.slurm/config``, ``sky check slurm``."""
        import fcntl

        self._lock = open(LOCK, "a")  # noqa: SIM115 - held until stop()
        deadline = time.time() + lock_timeout
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    self._lock.close()
                    raise RuntimeError(f"another test session held {LOCK} for {lock_timeout:.0f} s") from None
                time.sleep(1.0)
        self._api_was_running = _api_server_running()
        self._t0 = time.time()
        self.root = Path(tempfile.mkdtemp(prefix="jd-sky-"))
        self.root.chmod(0o755)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        assert self.root is not None
        root = self.root
        try:
            pw = pwd.getpwnam(USER)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True, timeout=30)
            pw = pwd.getpwnam(USER)
        subprocess.run(["usermod", "-p", "*", USER], check=True, timeout=30)
        self.home = pw.pw_dir
        self._grant_python()
        key = root / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True,
                       timeout=30)  # fmt: skip
        auth = root / "authorized_keys"
        auth.write_text(Path(f"{key}.pub").read_text())
        auth.chmod(0o644)
        port = _free_port()
        self.port = port
        conf = root / "sshd_config"
        conf.write_text("\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {root / 'host_key'}", f"PidFile {root / 'sshd.pid'}",
            f"AuthorizedKeysFile {auth}", "UsePAM no", "StrictModes no", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PubkeyAuthentication yes", "PermitRootLogin no",
            f"AllowUsers {USER}", "Subsystem sftp internal-sftp",
            f"SetEnv SLURM_CONF={self.slurm.env['SLURM_CONF']} SSL_CERT_FILE={CERTS}",
        ]) + "\n")  # fmt: skip
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        log = open(root / "sshd.log", "ab")  # noqa: SIM115
        self.sshd = subprocess.Popen([sshd, "-D", "-e", "-f", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        log.close()
        ssh = ["ssh", "-i", str(key), "-p", str(port), "-o", "StrictHostKeyChecking=no", "-o",
               "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", f"{USER}@127.0.0.1"]  # fmt: skip
        deadline = time.time() + 20
        while True:
            res = subprocess.run([*ssh, "sinfo -h -o %P"], capture_output=True, text=True, timeout=20, check=False)
            if res.returncode == 0 and res.stdout.strip():
                break
            if time.time() > deadline:
                raise RuntimeError(f"ssh to the login node failed: {res.stderr[-500:]}; sshd log: "
                                   f"{(root / 'sshd.log').read_text()[-500:]}")  # fmt: skip
            time.sleep(0.3)
        cfg = Path.home() / ".slurm" / "config"
        if cfg.exists():
            self._slurm_config_backup = cfg.read_bytes()
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text("\n".join([
            f"Host {ALIAS}", "  HostName 127.0.0.1", f"  Port {port}", f"  User {USER}", f"  IdentityFile {key}",
            "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null",
        ]) + "\n")  # fmt: skip
        self._created_config = True
        sky = shutil.which("sky") or str(Path(sys.executable).parent / "sky")
        res = subprocess.run([sky, "check", "slurm"], capture_output=True, text=True, timeout=180, check=False)
        if res.returncode != 0 or "enabled" not in res.stdout.lower():
            raise RuntimeError(f"sky check slurm failed: {res.stdout[-1500:]} {res.stderr[-1500:]}")

    def _grant_python(self) -> None:
        """Let the job user traverse to this interpreter and venv (e.g. pyenv under a 0700 /root): ``o+x`` on the
        folders on the way that lack it, restored by :meth:`stop`. Nothing is made readable that was not."""
        targets = [Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(__file__).resolve().parents[1]]
        for target in targets:
            for folder in target.parents:
                mode = folder.stat().st_mode
                if not mode & 0o001 and folder not in self._granted:
                    self._granted[folder] = mode & 0o7777
                    folder.chmod((mode & 0o7777) | 0o001)

    def seed(self, cluster: str) -> None:
        """Put uv, its config and the runtime venv where SkyPilot's set-up of ``cluster`` looks for them."""
        user_hash = (Path.home() / ".sky" / "user_hash").read_text().strip()
        name = f"{cluster}-{user_hash}"
        pw = pwd.getpwnam(USER)
        chome = Path(self.home) / ".sky_clusters" / name
        (chome / ".local" / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(str(_uv()), chome / ".local" / "bin" / "uv")
        (chome / ".config" / "uv").mkdir(parents=True, exist_ok=True)
        (chome / ".config" / "uv" / "uv.toml").write_text("system-certs = true\n")
        runtime = Path("/tmp") / name
        runtime.mkdir(parents=True, exist_ok=True)
        for path in (Path(self.home) / ".sky_clusters", runtime):
            subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(path)], check=True, timeout=30)
        subprocess.run(["su", "-s", "/bin/bash", USER, "-c",
                        f"{chome}/.local/bin/uv venv -q --seed {runtime}/skypilot-runtime --python /usr/bin/python3"],
                       check=True, timeout=120, capture_output=True)  # fmt: skip

    def torch_extensions(self) -> str:
        """A ``TORCH_EXTENSIONS_DIR`` the job user can write, holding a copy of the DeepSpeed ops this checkout built
        (the suite's ``TORCH_EXTENSIONS_DIR``: tests/conftest.py's ``deepspeed_ops`` built them before the first slow
        test), so a ZeRO job loads them instead of compiling them.

        A fresh copy in this session's folder, never one kept from an earlier session: ninja rebuilds an op whose build
        command changed, and the command names the DeepSpeed install's paths. A folder kept in the job user's home
        was shared by every checkout on the machine (seen: ``/work/main`` and ``/check/work/main`` taking turns), so
        the job rebuilt ``deepspeed_shm_comm`` (150 s under load) whenever another checkout had run last. torch's
        build ``lock`` is not copied (a copied one would make the job wait for a build that never ends). The suite's
        folder is shared by those checkouts too, so its ops are loaded (built again if another checkout's run rebuilt
        them since this session's first slow test) right before the copy: a build there is outside the job's wait."""
        assert self.root is not None
        pw = pwd.getpwnam(USER)
        target = self.root / "torch_extensions"
        if not target.exists():
            from conftest import build_deepspeed_ops

            build_deepspeed_ops(apart=False, wait=True)
            cache = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # the suite's one folder (tests/conftest.py)
            if cache.is_dir():
                shutil.copytree(cache, target, ignore=shutil.ignore_patterns("lock"))
            target.mkdir(exist_ok=True)
            subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", str(target)], check=True, timeout=60)
        return str(target)

    def stop(self) -> None:
        """Stop sshd, restore ``~/.slurm/config``, remove the folder (the job user stays, with nothing running)."""
        if self.sshd is not None and self.sshd.poll() is None:
            os.killpg(self.sshd.pid, signal.SIGTERM)
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.sshd.pid, signal.SIGKILL)
                self.sshd.wait(timeout=5)
        if self._created_config:
            cfg = Path.home() / ".slurm" / "config"
            if self._slurm_config_backup is not None:
                cfg.write_bytes(self._slurm_config_backup)
            else:
                cfg.unlink(missing_ok=True)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        for folder, mode in self._granted.items():
            folder.chmod(mode)
        self._granted.clear()
        if self.home:  # the job user exists only for these tests: whatever still runs as it was started by them
            self.leftovers = kill_user_processes(USER)
        if not getattr(self, "_api_was_running", True) and _api_server_running():  # the SDK started it: stop it
            sky = shutil.which("sky") or str(Path(sys.executable).parent / "sky")
            subprocess.run([sky, "api", "stop"], capture_output=True, timeout=60, check=False)
            self._reap_sky_helpers()
        lock = getattr(self, "_lock", None)
        if lock is not None:  # closing the file releases the flock
            lock.close()
            self._lock = None

    def _reap_sky_helpers(self, within: float = 10.0) -> None:
        """The API server's ``subprocess_daemon.py`` helpers end when their request does; kill those left (by PID)."""
        import psutil

        def ours() -> list[Any]:
            found = []
            for proc in psutil.process_iter(["cmdline", "create_time"]):
                try:
                    cmd = " ".join(proc.info["cmdline"] or [])
                    if "sky/skylet/subprocess_daemon.py" in cmd and proc.info["create_time"] >= self._t0 - 1:
                        found.append(proc)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            return found

        deadline = time.time() + within
        while ours() and time.time() < deadline:
            time.sleep(0.5)
        for proc in ours():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def require_sky_slurm() -> None:
    """Skip (or fail with ``JD_REQUIRE_SLURM``) when SkyPilot on the local SLURM cluster cannot run."""
    import pytest

    reason = SkySlurm.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("JD_REQUIRE_SLURM", "") not in ("", "0"):
        pytest.fail(f"JD_REQUIRE_SLURM is set but SkyPilot on SLURM cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


if __name__ == "__main__":  # manual check: python tests/sky_slurm.py
    with SlurmCluster() as c:
        os.environ.update(c.env)
        s = SkySlurm(c)
        t0 = time.time()
        s.start()
        print(f"sky check slurm ok in {time.time() - t0:.1f} s")
        s.stop()
