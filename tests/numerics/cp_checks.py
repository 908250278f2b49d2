"""Under torchrun with JD_STRATEGY=fsdp2 JD_CP=2 on 4 processes (dp2 x cp2): everything around the ring attention.

Prints ``CASE name: message`` for each wrong input (one line each) and ``CHECK name: ok`` for each property: the
data-parallel rank counts dp only (the two ranks of a cp group share it), the load-balanced chunks and positions
each rank holds, and the round trip ``cp_unshard(cp_shard(x)) == x``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import jupyter_dist.worker as jd
from jupyter_dist.models import Transformer
from jupyter_dist.worker import WorkerError
from jupyter_dist.worker._context import head_tail_order


def case(name: str, call) -> None:  # noqa: ANN001
    try:
        call()
    except WorkerError as e:
        assert "\n" not in str(e), str(e)
        if jd.rank == 0:
            print(f"CASE {name}: {e}", flush=True)
    else:
        print(f"CASE {name}: no error", flush=True)


def hf(kind: str, **extra: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg)


case("before-wrap", lambda: jd.cp_shard(torch.zeros(2, 8)))
case("hf-model", lambda: jd.wrap(hf("gemma2")))
case("hf-sliding", lambda: jd.wrap(hf("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)))
model, _ = jd.wrap(Transformer(vocab_size=64, dim=32, n_heads=4))
case("odd-length", lambda: jd.cp_shard(torch.zeros(2, 14)))
case("lengths-differ", lambda: jd.cp_shard(torch.zeros(2, 8), torch.zeros(2, 16)))
case("nothing", lambda: jd.cp_shard())

# the mesh: dp_shard=2 x cp=2, cp inner; dp_rank counts data-parallel ranks only
assert jd.mesh.describe() == "dp_shard=2 x cp=2", jd.mesh.describe()
cp_rank = jd.mesh["cp"].get_local_rank()
got = [None] * jd.world_size
dist.all_gather_object(got, (jd.dp_rank, jd.dp_size, cp_rank))
assert got == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)], got
if jd.rank == 0:
    print("CHECK dp-rank: ok", flush=True)

# the chunks: rank r of cp holds chunks r and 2cp-1-r of 2cp (head-tail), batch rows untouched
seq = 16
x = torch.arange(3 * seq * 5).reshape(3, seq, 5)
t = torch.arange(3 * seq).reshape(3, seq)
xs, ts = jd.cp_shard(x, t)
want = head_tail_order(seq, 2)[cp_rank]
assert want == ([0, 1, 2, 3, 12, 13, 14, 15] if cp_rank == 0 else [4, 5, 6, 7, 8, 9, 10, 11]), want
assert torch.equal(xs, x[:, want]) and torch.equal(ts, t[:, want]), (xs.shape, ts)
if jd.rank == 0:
    print("CHECK chunks: ok", flush=True)

# the positions the wrapped model receives are the same chunks of 0..seq-1
seen: dict[str, torch.Tensor] = {}


def keep(module: torch.nn.Module, args: tuple) -> None:
    seen["pos"] = args[1]


hook = model.layers["0"].attention.register_forward_pre_hook(keep)
with torch.no_grad():
    model(ts % 64)
hook.remove()
assert seen["pos"].tolist() == want, seen
if jd.rank == 0:
    print("CHECK positions: ok", flush=True)

# round trip
back_x, back_t = jd.cp_unshard(xs, ts)
assert torch.equal(back_x, x) and torch.equal(back_t, t)
one = jd.cp_unshard(xs)
assert torch.equal(one, x)
if jd.rank == 0:
    print("CHECK round-trip: ok", flush=True)

# on CPU the ring exchanges key/value blocks (and their gradients) through blocking c10d all-to-alls
# (worker/_context.py's BlockingRotater), never through the functional collectives' async work
import torch.distributed._functional_collectives as ft_c  # noqa: E402

from jupyter_dist.worker._context import BlockingRotater  # noqa: E402

counts = {"functional": 0, "blocking": 0}
saved = ft_c.permute_tensor, ft_c.all_gather_single, BlockingRotater.exchange_buffers


def counted(name: str, fn):  # noqa: ANN001, ANN202
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counts[name] += 1
        return fn(*args, **kwargs)

    return call


ft_c.permute_tensor = counted("functional", saved[0])
ft_c.all_gather_single = counted("functional", saved[1])
BlockingRotater.exchange_buffers = counted("blocking", saved[2])
try:
    model(ts % 64).float().sum().backward()
finally:
    ft_c.permute_tensor, ft_c.all_gather_single, BlockingRotater.exchange_buffers = saved
n_layers = len(model.layers)
# per layer: forward 1 key/value exchange (cp=2), backward 1 key/value and 2 gradient exchanges
assert counts == {"functional": 0, "blocking": 4 * n_layers}, counts
if jd.rank == 0:
    print("CHECK blocking-ring: ok", flush=True)
