"""The real run a rehearsal is checked against: under ``torchrun --nproc-per-node N``, each rank runs a rehearsal's
spec with the real (gloo) process group.

``python -m torch.distributed.run --nproc-per-node N rehearse_real.py SPEC.json OUT_PREFIX [SPEC.json OUT_PREFIX
...]``: for each spec in turn, every rank builds the worker runtime of the spec's launch contract for its own ``RANK``
(the same :class:`~jupyter_dist.worker._env.WorkerEnv` a rehearsal builds), and runs
:func:`jupyter_dist.worker._rehearse.run_rank` -- the instrument the rehearsal uses -- with the real collectives; it
writes ``OUT_PREFIX.rank<r>.json``. Several specs of one world size share the launch (one process group, a new
runtime and model per spec; a spec that imports DeepSpeed goes last, its import patches torch for the process). Used
by tests/test_rehearse.py.
"""

from __future__ import annotations

# first, as %%dist_train's preamble does: a rank imports torch outside the collector (a faster start)
import jupyter_dist.worker  # noqa: F401

# isort: split
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from jupyter_dist.worker._rehearse import _env, run_rank
from jupyter_dist.worker._runtime import Runtime


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 2 == 0, "usage: rehearse_real.py SPEC.json OUT_PREFIX [SPEC.json OUT_PREFIX ...]"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for spec_path, out in zip(args[::2], args[1::2], strict=True):
        with open(spec_path) as f:
            spec = json.load(f)
        assert world == spec["world_size"], (world, spec["world_size"])
        spec = {**spec, "rank": rank}
        runtime = Runtime(_env(spec))
        runtime.init()  # the real process group (gloo), as a launched worker makes it; the first spec's, kept
        result = run_rank(runtime, spec, torch.device("cpu"))
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(result, f)
        runtime.model = runtime.optimizer = runtime.mesh = runtime.pipeline = None  # nothing kept for the next spec
        del runtime
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
