"""The real run a rehearsal is checked against: under ``torchrun --nproc-per-node N``, each rank runs a rehearsal's
spec with the real (gloo) process group.

``python -m torch.distributed.run --nproc-per-node N rehearse_real.py SPEC.json OUT_PREFIX``: every rank builds the
worker runtime of the spec's launch contract for its own ``RANK`` (the same :class:`~jupyter_dist.worker._env.
WorkerEnv` a rehearsal builds), and runs :func:`jupyter_dist.worker._rehearse.run_rank` -- the instrument the
rehearsal uses -- with the real collectives; it writes ``OUT_PREFIX.rank<r>.json``. Used by tests/test_rehearse.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from jupyter_dist.worker._rehearse import _env, run_rank
from jupyter_dist.worker._runtime import Runtime


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == spec["world_size"], (world, spec["world_size"])
    spec = {**spec, "rank": rank}
    runtime = Runtime(_env(spec))
    runtime.init()  # the real process group (gloo), as a launched worker makes it
    result = run_rank(runtime, spec, torch.device("cpu"))
    with open(f"{sys.argv[2]}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
