"""A real SLURM cluster on this machine for tests: munged, slurmctld and two ``slurmd -N <name>`` on 127.0.0.1.

Follows docs/recipes.md "SLURM on one machine": two node names that resolve to this host (``localhost`` and the
short hostname), different slurmd ports, ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres``,
``auth/munge`` with munged started as the munge user on its own socket and key, every state/spool/pid/log path in a
temporary folder, and ``SLURM_CONF`` pointing at its ``slurm.conf``. Accounting is off.

``SlurmCluster.unavailable_reason()`` says why it cannot run (not root, Debian packages missing); the pytest fixture
skips then, or fails when ``JD_REQUIRE_SLURM`` is set (``.ci/run`` sets it). Every daemon runs in the foreground as
our child, so stopping the cluster kills exactly the processes it started.

Usable outside pytest too (a notebook test, a manual check)::

    with SlurmCluster() as c:
        print(c.env["SLURM_CONF"])
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"


def _exe(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                      None)  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_names(short: str) -> list[str]:
    """Names of this host that resolve to a loopback address: the short hostname, then other /etc/hosts aliases.

    Not ``localhost``: Slurm replaces that node name with the machine's hostname, which then appears twice.
    """
    names = [short] if short != "localhost" else []
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0].startswith("127."):
            names += [w for w in words[1:] if w not in names and w != "localhost" and "." not in w]
    good = []
    for n in names:
        try:
            if socket.gethostbyname(n).startswith("127."):
                good.append(n)
        except OSError:
            continue
    return good


class SlurmCluster:
    """Start/stop a 2-node SLURM cluster (both nodes are this host) in a fresh temporary folder."""

    def __init__(self, *, nodes: int = 2, cpus: int | None = None, partition: str = "debug") -> None:
        self.nodes_wanted = nodes
        self.cpus = cpus or max(2, os.cpu_count() or 2)
        self.partition = partition
        self.root: Path | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node_names: list[str] = []
        self.env: dict[str, str] = {}

    # ---- availability -------------------------------------------------------------------------------------------
    @staticmethod
    def unavailable_reason() -> str | None:
        """Why a cluster cannot be started here, or None."""
        if os.geteuid() != 0:
            return "the SLURM test cluster needs root (slurmd, munged as the munge user)"
        missing = [n for n in (*DAEMONS, *CLIENTS) if _exe(n) is None]
        if missing:
            return f"SLURM/munge not installed ({', '.join(missing)} missing): apt-get install {PACKAGES}"
        try:
            pwd.getpwnam("munge")
        except KeyError:
            return "no munge user: apt-get install munge"
        return None

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        """Write the config, start munged, slurmctld and the slurmds, wait until every node is idle."""
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.root = Path(tempfile.mkdtemp(prefix="jd-slurm-"))
        self.root.chmod(0o755)  # munge and job users must traverse it
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        assert self.root is not None
        root = self.root
        munge = pwd.getpwnam("munge")
        mdir = root / "munge"
        mdir.mkdir()
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for p in (mdir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        mdir.chmod(0o755)
        sock = mdir / "munge.socket"
        self._spawn(
            [_exe("munged") or "munged", "-F", f"--socket={sock}", f"--key-file={key}", f"--log-file={mdir / 'log'}",
             f"--pid-file={mdir / 'pid'}", f"--seed-file={mdir / 'seed'}", "--force"],
            user=munge, log=root / "munged.out",
        )  # fmt: skip
        self._wait(lambda: sock.exists(), 15, "munged did not create its socket")
        short = socket.gethostname().split(".")[0]
        self.node_names = loopback_names(short)[: self.nodes_wanted]
        if len(self.node_names) < self.nodes_wanted:
            raise RuntimeError(
                f"need {self.nodes_wanted} host names that resolve to 127.x (Slurm reads NodeName=localhost as the "
                f"machine's own name), have {self.node_names}: add one to /etc/hosts"
            )
        for name in self.node_names:
            try:
                socket.gethostbyname(name)
            except OSError:
                raise RuntimeError(f"node name {name!r} does not resolve (add it to /etc/hosts)") from None
        (root / "state").mkdir()
        for name in self.node_names:
            (root / "spool" / name).mkdir(parents=True)
        ctld_port = _free_port()
        node_lines = [
            f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={self.cpus} "
            "RealMemory=2000 State=UNKNOWN"
            for n in self.node_names
        ]
        conf = root / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=jdtest",
            f"SlurmctldHost={short}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "SlurmUser=root", "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "MpiDefault=none", "MailProg=/bin/true", "ReturnToService=2", "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd-%n.log'}",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "MinJobAge=300", "KillWait=5",
            "SchedulerType=sched/backfill",
            *node_lines,
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")  # fmt: skip
        conf.chmod(0o644)
        self.env = {"SLURM_CONF": str(conf)}
        env = {**os.environ, **self.env}
        self._spawn([_exe("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                    log=root / "slurmctld.out")  # fmt: skip
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout, "slurmctld did not answer")
        for name in self.node_names:
            self._spawn([_exe("slurmd") or "slurmd", "-D", "-N", name, "-f", str(conf)], env=env,
                        log=root / f"slurmd-{name}.out")  # fmt: skip
        self._wait(self._all_idle, timeout, "the nodes did not become idle")

    def _all_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return len(states) == len(self.node_names) and all(s.startswith("idle") for s in states.values())

    def _run(self, argv: list[str], timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip

    def _spawn(self, argv: list[str], *, log: Path, user: Any = None, env: dict[str, str] | None = None) -> None:
        fh = open(log, "ab")  # noqa: SIM115 - handed to the daemon
        kwargs: dict[str, Any] = {}
        if user is not None:
            kwargs.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        try:
            self.procs.append(subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, start_new_session=True, **kwargs))  # fmt: skip
        finally:
            fh.close()

    def _wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {p.args[0]} exited with {p.returncode}; {self.log_tail()}")
            try:
                if check():
                    return
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout:.0f} s; {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon log (for failure messages)."""
        if self.root is None:
            return ""
        out = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def jobs(self) -> list[str]:
        """Job ids the controller still knows as pending or running."""
        res = self._run(["squeue", "-h", "-o", "%i %T"])
        return [ln.split()[0] for ln in res.stdout.splitlines() if ln.split()[1:] and ln.split()[1] in
                ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]  # fmt: skip

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmds first), remove the folder. Leaves no process behind."""
        if self.procs and self.env:
            try:
                self._run(["scancel", "--full", "--user", "root"], timeout=10)
                deadline = time.time() + 15
                while self.jobs() and time.time() < deadline:
                    time.sleep(0.3)
            except (OSError, subprocess.SubprocessError):
                pass
        for p in reversed(self.procs):  # slurmds, then slurmctld, then munged
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        self.procs = []
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


if __name__ == "__main__":  # manual check: python tests/slurm_cluster.py
    t0 = time.time()
    with SlurmCluster() as c:
        print(f"up in {time.time() - t0:.1f} s:", c._run(["sinfo"]).stdout, c.env)


# ------------------------------------------------------------------------------------------------ pytest fixture
def require_slurm() -> None:
    """Skip the calling test when no SLURM cluster can run here, or fail it when ``JD_REQUIRE_SLURM`` is set (CI)."""
    import pytest

    reason = SlurmCluster.unavailable_reason()
    if reason is None:
        return
    if os.environ.get("JD_REQUIRE_SLURM", "") not in ("", "0"):
        pytest.fail(f"JD_REQUIRE_SLURM is set but the SLURM test cluster cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _fixture() -> Any:
    import pytest

    @pytest.fixture(scope="session")
    def slurm_cluster() -> Any:
        """A real 2-node SLURM cluster on this machine for the whole test session; ``SLURM_CONF`` set meanwhile."""
        require_slurm()
        cluster = SlurmCluster()
        cluster.start()
        old = os.environ.get("SLURM_CONF")
        os.environ.update(cluster.env)
        try:
            yield cluster
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
            cluster.stop()

    return slurm_cluster


slurm_cluster = _fixture()
