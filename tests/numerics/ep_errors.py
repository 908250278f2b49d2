"""Under torchrun with JD_EP=2: each wrong input to jd.wrap gets one line; print them for the test to read."""

from __future__ import annotations

import jupyter_dist.worker as jd
from jupyter_dist.models import MoETransformer, Transformer
from jupyter_dist.worker import WorkerError

cases = {
    "dense": lambda: jd.wrap(Transformer(vocab_size=64, dim=64)),
    "experts": lambda: jd.wrap(MoETransformer(vocab_size=64, dim=64, n_experts=3, top_k=1)),
}
for name, call in cases.items():
    try:
        call()
    except WorkerError as e:
        assert "\n" not in str(e), str(e)
        if jd.rank == 0:
            print(f"CASE {name}: {e}", flush=True)
    else:
        print(f"CASE {name}: no error", flush=True)
