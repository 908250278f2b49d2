"""Train several generated ``train.py`` scripts in turn in the ranks of one torchrun launch.

``torchrun --nproc-per-node N tests/_script_driver.py SPEC.json``: SPEC is a list of runs ``{"name", "script",
"argv", "env", "cwd", "log"}``. Each rank runs each script in turn with ``runpy.run_path(script,
run_name="__main__")``, as torchrun would start it: ``sys.argv`` is ``[script, *argv]``, the environment is the
launch's plus the run's, the working directory the run's. The script's own ``dist.init_process_group`` and
``dist.destroy_process_group`` run for real; each run's group rendezvous under its own key prefix of the launch's
store (a process group made after one was destroyed would otherwise read the previous group's keys). Each rank writes
what the run prints to ``<log>.rank<R>`` and its outcome (``{"rc": 0}`` or the traceback) to ``<log>.rank<R>.json``.

A run that fails ends the launch (its ranks' peers would wait in a collective): the later runs have no outcome file,
and their tests fail with the launch's log. A run with ``"expect_failure": true`` (on one rank) records its
traceback and the launch goes on. Between runs the process group is destroyed (the script did; the driver makes
sure), and the module-level state the scripts' libraries keep (DTensor's random-number tracker, dynamo's caches) is
reset: each run starts as a fresh process would, but for ``import torch``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import sys
import traceback

_DTENSOR_CACHES = (
    ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached.cache_clear"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)
"""(module, attribute path) of each cache function the driver calls between runs."""


def _reset_torch_state() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    with contextlib.suppress(ImportError, AttributeError):
        import torch.distributed.tensor._random as dtensor_random

        dtensor_random._rng_tracker = None
    # caches keyed by meshes, which compare by layout, each cleared on its own: a name a later torch drops skips only
    # its own clear (the C++ dispatch fast path's is the one a tp run after a tp+sp run needs)
    for module, path in _DTENSOR_CACHES:
        with contextlib.suppress(ImportError, AttributeError):
            target: object = importlib.import_module(module)
            for name in path.split("."):
                target = getattr(target, name)
            target()  # type: ignore[operator]
    torch._dynamo.reset()
    gc.collect()


def main() -> None:
    import torch.distributed as dist

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          use_libuv=True)  # the torchrun agent's store (TORCHELASTIC_USE_AGENT_STORE)  # fmt: skip
    real_init = dist.init_process_group
    base_env, base_cwd = dict(os.environ), os.getcwd()
    for i, run in enumerate(spec):

        def init_process_group(backend: str | None = None, *, _run: int = i, **kwargs: object) -> None:
            if "store" not in kwargs and kwargs.get("init_method") in (None, "env://"):
                kwargs.pop("init_method", None)
                kwargs.update(store=dist.PrefixStore(f"run-{_run}/", store), rank=rank, world_size=world)
            real_init(backend, **kwargs)  # type: ignore[arg-type]

        dist.init_process_group = init_process_group  # type: ignore[assignment]
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(run["env"])
        os.chdir(run["cwd"])
        sys.argv = [run["script"], *run["argv"]]
        log = f"{run['log']}.rank{rank}"
        outcome: dict[str, object] = {"rc": 0}
        with open(log, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            try:
                runpy.run_path(run["script"], run_name="__main__")
            except BaseException as err:  # noqa: BLE001 - SystemExit too: the run's exit status is its outcome
                code = err.code if isinstance(err, SystemExit) else 1
                if code not in (0, None):
                    traceback.print_exc()
                    outcome = {"rc": code if isinstance(code, int) else 1, "error": traceback.format_exc()}
        if outcome["rc"] != 0 and not run.get("expect_failure"):
            with open(f"{log}.json", "w") as f:
                json.dump(outcome, f)
            sys.stderr.write(f"run {run['name']} failed on rank {rank}:\n{outcome['error']}")
            sys.stderr.flush()
            os._exit(1)
        _reset_torch_state()
        with open(f"{log}.json", "w") as f:
            json.dump(outcome, f)
        os.chdir(base_cwd)
    dist.init_process_group = real_init  # type: ignore[assignment]


if __name__ == "__main__":
    main()
