"""Where a run's processes start, one module per back-end behind :class:`jupyter_dist.launch.base.Launcher`.

* :mod:`.local` — torchrun / deepspeed / accelerate on this machine (the default);
* :mod:`.slurm` — an ``sbatch`` job on a SLURM cluster;
* :mod:`.skypilot` — a SkyPilot task or managed job on a cloud or a Kubernetes/SLURM pool;
* :mod:`.cluster` — what SLURM and SkyPilot share: cluster options, the shipped cell, the remote launch contract;
* :mod:`.stream` — the log and telemetry stream a remote back-end brings home into the run directory.

See docs/architecture.md, "Where to add things", for how to add one.
"""
