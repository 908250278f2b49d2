"""What a cluster job carries (jupyter_dist/launch/remote_env.py, project.py): the wheel, the pins, the project.

No cluster here: the wheel is built from the imported package and installed by a real ``pip --no-index`` into a
folder that a fresh interpreter imports from; the version check runs the real bootstrap in a subprocess with a
deliberately different ``JD_VERSIONS``; the GPU cloud task goes through the magic's dry run and SkyPilot's own
parser. The jobs that really run on the local SLURM and SkyPilot-on-SLURM clusters are in test_ship_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import jupyter_dist
from jupyter_dist.errors import JupyterDistError
from jupyter_dist.launch.project import (
    check_workdir,
    mount_config,
    parse_mount,
    parse_size,
    script_runner,
    workdir_files,
)
from jupyter_dist.launch.remote_env import (
    RemoteEnv,
    kernel_pins,
    kernel_version,
    package_wheel,
    parse_versions,
    torch_variant,
    version_mismatches,
    versions_env,
)

PKG = Path(jupyter_dist.__file__).resolve().parent


def _copy_package(dst: Path) -> Path:
    import shutil

    shutil.copytree(PKG, dst / "jupyter_dist", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst / "jupyter_dist"


# ---- the package ---------------------------------------------------------------------------------------------------
def test_wheel_holds_exactly_the_imported_package_and_is_cached_by_content(tmp_path: Path) -> None:
    wheel = package_wheel(tmp_path / "cache")
    assert wheel.source == PKG and wheel.version.endswith(f"+jd.{wheel.digest}") and len(wheel.digest) == 12
    with zipfile.ZipFile(wheel.path) as zf:
        names = set(zf.namelist())
        for path in PKG.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            rel = "jupyter_dist/" + path.relative_to(PKG).as_posix()
            assert zf.read(rel) == path.read_bytes(), rel
        meta = zf.read(f"jupyter_dist-{wheel.version}.dist-info/METADATA").decode()
    assert not [n for n in names if n.endswith(".pyc")]
    assert f"Version: {wheel.version}" in meta and "Requires-Dist: cloudpickle" in meta
    mtime = wheel.path.stat().st_mtime_ns
    assert package_wheel(tmp_path / "cache") == wheel and wheel.path.stat().st_mtime_ns == mtime  # cached
    # a changed file is another wheel (another hash)
    src = _copy_package(tmp_path / "src")
    assert package_wheel(tmp_path / "cache", package_dir=src).digest == wheel.digest  # same content, same hash
    (src / "launch" / "remote_env.py").write_text((src / "launch" / "remote_env.py").read_text() + "\n# edited\n")
    other = package_wheel(tmp_path / "cache", package_dir=src)
    assert other.digest != wheel.digest and other.path != wheel.path and other.path.exists()


def test_the_wheel_installs_without_any_index_and_is_what_imports(tmp_path: Path) -> None:
    """The set-up's own pip line (--no-index) installs it; a fresh interpreter imports jupyter_dist from there."""
    wheel = package_wheel(tmp_path / "cache")
    renv = RemoteEnv(wheel=wheel, pins={})
    job = tmp_path / "job"
    (job / ".jd").mkdir(parents=True)
    (job / ".jd" / wheel.name).write_bytes(wheel.path.read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"  # any registry request would fail
    # two nodes sharing the folder (a SLURM home) install at once: both succeed, one folder results
    script = renv.setup_script().replace("python3", sys.executable)
    procs = [subprocess.Popen(["bash", "-c", script], cwd=job, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert sorted(p.name for p in (job / ".jd").iterdir()) == sorted([wheel.name, f"site-{wheel.digest}"])
    again = subprocess.run(["bash", "-x", "-c", script], cwd=job, env=env, capture_output=True, text=True, timeout=60,
                           check=True)  # fmt: skip
    assert "pip install" not in again.stderr  # installed already: the hash in the folder's name says it is this code
    probe = (
        "import os, sys; sys.path.insert(0, os.path.abspath(os.environ['JD_SITE'])); import jupyter_dist; "
        "from importlib.metadata import version; print(jupyter_dist.__file__); print(version('jupyter-dist'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=job, env={**env, "JD_SITE": wheel.site},
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()  # fmt: skip
    assert out[0] == str(job / wheel.site / "jupyter_dist" / "__init__.py") and out[1] == wheel.version
    record = (job / wheel.site / f"jupyter_dist-{wheel.version}.dist-info" / "RECORD").read_text()
    assert "jupyter_dist/launch/remote_env.py,sha256=" in record


# ---- the versions --------------------------------------------------------------------------------------------------
def test_pins_are_the_kernels_versions() -> None:
    import torch

    pins = kernel_pins(strategy="zero2")
    assert pins["torch"] == kernel_version("torch") and pins["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert {"cloudpickle", "pyyaml", "psutil", "deepspeed"} <= set(pins)
    assert "deepspeed" not in kernel_pins(strategy="ddp") or "deepspeed" in sys.modules


@pytest.mark.parametrize(("kernel", "acc", "vendor", "want"), [
    ("2.13.0+cpu", "h100-80gb", "nvidia", "cu128"), ("2.13.0+cpu", "v100-32gb", "nvidia", "cu126"),
    ("2.13.0+cu126", "h100-80gb", "nvidia", "cu126"), ("2.13.0", "mi300x", "amd", "rocm6.4"),
    ("2.13.0+cu128", "cpu", "cpu", "cpu"),
])  # fmt: skip
def test_torch_build_for_the_remote_accelerator(kernel: str, acc: str, vendor: str, want: str) -> None:
    assert torch_variant(kernel, acc, vendor) == want


def test_a_mismatch_is_one_line_per_package() -> None:
    want = {
        "torch": "2.13.0+cpu",
        "cloudpickle": "3.1.3",
        "numpy": "2.0.0",
        "python": "3.11.2",
        "jupyter-dist": "0.1.0+jd.a",
    }
    have = {"torch": "2.13.0+cu128", "cloudpickle": "3.0.0", "numpy": None, "python": "3.10.9",
            "jupyter-dist": "0.1.0+jd.b"}  # fmt: skip
    lines = version_mismatches(want, have)
    assert lines == [
        "jupyter-dist: version mismatch: cloudpickle 3.0.0 here, 3.1.3 in the kernel",
        "jupyter-dist: version mismatch: numpy is not installed here, the kernel has 2.0.0",
        "jupyter-dist: version mismatch: python 3.10.9 here, 3.11.2 in the kernel",
        "jupyter-dist: version mismatch: jupyter-dist 0.1.0+jd.b here, 0.1.0+jd.a in the kernel",
    ]  # torch's build label is not a mismatch (a CPU kernel pins the CUDA build for GPU nodes)
    assert parse_versions(versions_env(want)) == want
    with pytest.raises(JupyterDistError, match="write name=version"):
        parse_versions("torch")


def test_the_bootstrap_reports_mismatches_before_the_script_runs(tmp_path: Path) -> None:
    """The real bootstrap of every rank, with a contract whose torch and cloudpickle differ from this interpreter's."""
    from jupyter_dist.launch.backends.slurm import BOOTSTRAP_STUB

    (tmp_path / "jd_bootstrap.py").write_text(BOOTSTRAP_STUB)
    (tmp_path / "script.py").write_text("print('training starts')\n")
    versions = versions_env({"torch": "1.0.0", "cloudpickle": "0.1", "psutil": kernel_version("psutil") or "x"})
    env = {**os.environ, "JD_VERSIONS": versions, "JD_LOG_STREAM": "1", "JD_RUN_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "jd_bootstrap.py", "script.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    err = res.stderr.splitlines()
    assert err == [
        f"[rank 0] jupyter-dist: version mismatch: torch {kernel_version('torch')} here, 1.0.0 in the kernel",
        f"[rank 0] jupyter-dist: version mismatch: cloudpickle {kernel_version('cloudpickle')} here, 0.1 in the kernel",
    ], res.stderr
    assert res.stdout == "[rank 0] training starts\n"


# ---- what gets installed -------------------------------------------------------------------------------------------
def test_setup_installs_the_wheel_never_a_registry_name(tmp_path: Path) -> None:
    wheel = package_wheel(tmp_path)
    pins = {"torch": "2.13.0+cpu", "cloudpickle": "3.1.3"}
    renv = RemoteEnv(wheel=wheel, pins=pins, torch_variant="cu128")
    text = renv.setup_script()
    assert f'--no-index --no-deps --target "$JD_TMP" .jd/{wheel.name}' in text and f'"{wheel.site}"' in text
    assert "torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128" in text
    assert "cloudpickle==3.1.3" in text and "jupyter-dist" not in text.replace(f".jd/{wheel.name}", "").split("#")[0]
    for line in text.splitlines():
        assert not line.strip().startswith("pip install -U jupyter-dist")
    assert "pip install -q --disable-pip-version-check -r .jd/requirements.txt" in RemoteEnv(
        wheel=wheel, pins=pins, requirements=".jd/requirements.txt").setup_script()  # fmt: skip
    image = RemoteEnv(wheel=wheel, pins=pins, image="docker:pytorch/pytorch").setup_script()
    assert "torch==" not in image and wheel.name in image
    custom = renv.setup_script("pip install -e .")
    assert custom.splitlines()[-1] == "pip install -e ." and "torch==" not in custom and wheel.name in custom
    slurm = RemoteEnv(wheel=wheel, pins=pins, site=f"{wheel.site}-node${{SLURM_NODEID}}").setup_script()
    assert f'export JD_SITE="$PWD/{wheel.site}-node${{SLURM_NODEID}}"' in slurm


# ---- the project ---------------------------------------------------------------------------------------------------
def test_mounts_are_validated_and_rendered(tmp_path: Path) -> None:
    assert parse_mount("/data=s3://my-bucket/path") == ("/data", "s3://my-bucket/path")
    assert parse_mount("~/ck=https://acct.blob.core.windows.net/box/x")[1].startswith("https://acct")
    assert parse_mount(f"/local={tmp_path}") == ("/local", str(tmp_path))
    for bad, msg in [("/data", "DEST=SOURCE"), ("data=s3://my-bucket", "absolute path"),
                     ("/d=ftp://host/x", "cannot mount ftp://"), ("/d=s3://B", "not a bucket name"),
                     ("/d=https://example.com/x", "Azure blob"), ("/d=/no/such/dir", "not a folder")]:  # fmt: skip
        with pytest.raises(JupyterDistError, match=msg):
            parse_mount(bad)
    fm = mount_config((("/data", "s3://ds-bucket/x"), ("/ckpt", "gs://ck-bucket/r")), "/ckpt/run1")
    assert fm == {"/data": {"source": "s3://ds-bucket/x", "mode": "MOUNT"},
                  "/ckpt": {"source": "gs://ck-bucket/r", "mode": "MOUNT_CACHED"}}  # fmt: skip


def test_workdir_honours_ignore_files_and_names_the_biggest_files(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "mymodule.py").write_text("X = 1\n")
    (proj / "pkg" / "helper.py").write_text("Y = 2\n")
    (proj / "data.bin").write_bytes(b"\0" * 300_000)
    (proj / "pkg" / "weights.pt").write_bytes(b"\0" * 200_000)
    (proj / ".gitignore").write_text("*.log\n")
    (proj / "pkg" / ".gitignore").write_text("cache/\n")
    (proj / "pkg" / "cache").mkdir()
    (proj / "pkg" / "cache" / "x.py").write_text("")
    (proj / "run.log").write_text("noise")
    (proj / ".git").mkdir()
    (proj / ".git" / "HEAD").write_text("ref")
    names = {n for n, _ in workdir_files(proj)}
    assert names == {"mymodule.py", "pkg/helper.py", "data.bin", "pkg/weights.pt", ".gitignore", "pkg/.gitignore"}
    with pytest.raises(JupyterDistError, match=r"biggest: data\.bin \(293\.0 KB\), pkg/weights\.pt") as err:
        check_workdir(proj, parse_size("100KB"))
    assert "--workdir-limit" in str(err.value)
    assert check_workdir(proj, parse_size("1GB"))[0] == 6
    (proj / ".skyignore").write_text("*.bin\n*.pt\n")  # .skyignore replaces the .gitignore rules, as in SkyPilot
    names = {n for n, _ in workdir_files(proj)}
    assert "data.bin" not in names and "run.log" in names and "pkg/cache/x.py" in names
    (proj / "script.py").write_text("")
    with pytest.raises(JupyterDistError, match="holds script.py"):
        check_workdir(proj, parse_size("1GB"))
    with pytest.raises(JupyterDistError, match="--workdir-limit '1 XB'"):
        parse_size("1 XB")


def test_script_runner_runs_a_script_as_python_would(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "sub" / "train.py").write_text(
        "import sys, helper\nif __name__ == '__main__':\n    print(sys.argv[1:], helper.VALUE, __file__)\n"
    )
    runner = tmp_path / "script.py"
    runner.write_text(script_runner(str(tmp_path / "sub" / "train.py"), ("--lr", "1e-3", "a b")))
    out = subprocess.run([sys.executable, str(runner)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         check=True).stdout  # fmt: skip
    assert out.strip() == f"['--lr', '1e-3', 'a b'] 7 {tmp_path / 'sub' / 'train.py'}"


# ---- the SDK boundary: a GPU cloud task ----------------------------------------------------------------------------
def test_gpu_cloud_task_has_the_wheel_cuda_torch_mounts_and_image(tmp_path: Path) -> None:
    sky = pytest.importorskip("sky")
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_dist")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "mymodule.py").write_text("X = 1\n")
    line = (f"--backend skypilot --nodes 2 --gpus H100:8 --infra aws --managed --dry-run --runs-dir {tmp_path} "
            f"--workdir {proj} --mount /data=s3://my-datasets/c4 --mount /ckpt=gs://my-ckpts/run "
            "--checkpoint-dir /ckpt/llama --image docker:nvcr.io/nvidia/pytorch:25.01-py3")  # fmt: skip
    dry = ip.run_cell_magic("dist_train", line, "import mymodule\n")
    task = yaml.safe_load(dry.files["task.yaml"])
    wheel = package_wheel()
    assert f".jd/{wheel.name}" in task["setup"] and "--no-index" in task["setup"]
    assert task["resources"]["image_id"] == "docker:nvcr.io/nvidia/pytorch:25.01-py3"
    assert "torch==" not in task["setup"]  # the image's torch is kept; the ranks still compare versions
    assert task["file_mounts"] == {"/data": {"source": "s3://my-datasets/c4", "mode": "MOUNT"},
                                   "/ckpt": {"source": "gs://my-ckpts/run", "mode": "MOUNT_CACHED"}}  # fmt: skip
    assert f"torch={kernel_version('torch')}" in task["envs"]["JD_VERSIONS"]
    assert task["envs"]["JD_SITE"] == wheel.site
    assert any("copies --workdir" in n for n in dry.notes) and any(wheel.version in n for n in dry.notes)
    parsed = sky.Task.from_yaml_config(task)  # SkyPilot's own parser
    assert parsed.num_nodes == 2 and set(parsed.storage_mounts) == {"/data", "/ckpt"}
    (res,) = parsed.resources
    assert res.accelerators == {"H100": 8} and res.extract_docker_image() == "nvcr.io/nvidia/pytorch:25.01-py3"
    # without an image: torch pinned to the kernel's version, CUDA 12.8 build from PyTorch's index
    dry = ip.run_cell_magic("dist_train", line.split(" --image")[0], "import mymodule\n")
    task = yaml.safe_load(dry.files["task.yaml"])
    public = kernel_version("torch").split("+")[0]  # type: ignore[union-attr]
    assert f"torch=={public}+cu128 --index-url https://download.pytorch.org/whl/cu128" in task["setup"]
    assert any(f"torch=={public}+cu128" in n for n in dry.notes)
    sky.Task.from_yaml_config(task)


# ---- cost before launch --------------------------------------------------------------------------------------------
VMS = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p5.48xlarge,H100,8,192,2048,,98.32,40.10,us-east-1,us-east-1a
p5.48xlarge,H100,8,192,2048,,99.50,,us-west-2,us-west-2a
p4d.24xlarge,A100,8,96,1152,,32.77,12.00,us-east-1,us-east-1a
m6i.large,,,2,8,,0.096,0.04,us-east-1,us-east-1a
"""


def test_price_from_skypilots_catalog_and_says_when_unknown(tmp_path: Path) -> None:
    from jupyter_dist.launch.cost import price_nodes

    (tmp_path / "aws").mkdir()
    (tmp_path / "aws" / "vms.csv").write_text(VMS)
    p = price_nodes("H100", 8, 2, infra="aws", root=tmp_path)
    assert (p.per_node_hour, p.instance, p.region, p.per_hour) == (98.32, "p5.48xlarge", "us-east-1", 196.64)
    assert p.estimate(0.5, 7200) == pytest.approx(196.64)  # one hour of steps
    assert "$196.64/hour for 2 x p5.48xlarge (aws us-east-1, on demand" in p.describe(0.5, 7200)
    assert "estimated $196.64 for 7200 steps" in p.describe(0.5, 7200)
    assert price_nodes("H100", 8, 1, infra="aws/us-west-2", root=tmp_path).per_node_hour == 99.50
    assert price_nodes("H100", 8, 1, spot=True, root=tmp_path).per_node_hour == 40.10  # any cloud here
    missing = price_nodes("H100", 4, 1, infra="aws", root=tmp_path)
    assert missing.per_node_hour is None and "no H100:4 instance in SkyPilot's price list for aws" in missing.reason
    gcp = price_nodes("H100", 8, 1, infra="gcp", root=tmp_path)
    assert "price list for gcp is not on this machine (`sky show-gpus H100:8 --infra gcp`" in gcp.describe()
    assert "your own cluster" in price_nodes("H100", 8, 1, infra="slurm", root=tmp_path).reason


def test_dry_run_shows_the_price(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sky")
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_dist.launch import cost

    (tmp_path / "cat" / "aws").mkdir(parents=True)
    (tmp_path / "cat" / "aws" / "vms.csv").write_text(VMS)
    monkeypatch.setattr(cost, "catalog_dir", lambda: tmp_path / "cat")
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_dist")
    base = f"--backend skypilot --nodes 2 --gpus A100:8 --dry-run --runs-dir {tmp_path}"
    dry = ip.run_cell_magic("dist_train", base + " --infra aws --steps 1000", "pass\n")
    (line,) = [n for n in dry.notes if n.startswith("price")]
    assert line.startswith("price: $65.54/hour for 2 x p4d.24xlarge (aws us-east-1, on demand") and "1000 steps" in line
    dry = ip.run_cell_magic("dist_train", base + " --infra gcp", "pass\n")
    assert any(n.startswith("price unknown: SkyPilot's price list for gcp is not on this machine") for n in dry.notes)
    assert "# price unknown" in dry.to_text()


def test_a_plain_script_on_a_log_stream_still_reports_its_exit(tmp_path: Path) -> None:
    """SkyPilot: the Run learns exit codes from stream records; a script without jd gets one from the bootstrap."""
    from jupyter_dist.launch.backends.slurm import BOOTSTRAP_STUB
    from jupyter_dist.telemetry.records import decode

    (tmp_path / "jd_bootstrap.py").write_text(BOOTSTRAP_STUB)
    (tmp_path / "script.py").write_text("raise ValueError('bad input')\n")
    env = {**os.environ, "JD_LOG_STREAM": "1", "JD_TELEMETRY_STDOUT": "1", "JD_RUN_DIR": str(tmp_path), "RANK": "1"}
    res = subprocess.run([sys.executable, "jd_bootstrap.py", "script.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert res.returncode == 1
    (rec,) = [r for r in map(decode, res.stdout.splitlines()) if r is not None]
    assert (rec["kind"], rec["rank"], rec["status"], rec["error_type"], rec["error"]) == (
        "exit", 1, "error", "ValueError", "bad input")  # fmt: skip
    (tmp_path / "script.py").write_text("import jupyter_dist.worker as jd\n")  # jd writes its own exit record
    res = subprocess.run([sys.executable, "jd_bootstrap.py", "script.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert [r["kind"] for r in map(decode, res.stdout.splitlines()) if r is not None].count("exit") == 1
