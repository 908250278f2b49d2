"""Templates: context parallelism (the sequence split over the ``cp`` ranks, ring attention).

PyTorch's ``context_parallel`` does the work, as in the workers (:mod:`jupyter_dist.worker._context`): it keeps this
rank's chunks of each buffer along the sequence, cut with causal load balancing (head-tail: ``2 x cp`` chunks,
rank ``r`` keeps chunks ``r`` and ``2cp-1-r``), and routes ``F.scaled_dot_product_attention`` to ring attention over
the cp group. On CPU, PyTorch 2.13 ships handlers for the CUDA attention kernels only; the script then registers
the CPU flash kernel pair into the same dispatcher table, run by PyTorch's own ring (the worker does the same; on
GPUs nothing is added), so the quick check on CPU processes runs the code path a cluster runs.
"""

from __future__ import annotations

__all__ = ["CONTEXT_PARALLEL"]

CONTEXT_PARALLEL = '''
def cpu_ring_attention() -> dict[Any, Any]:
    """CPU only: route the CPU attention kernels through PyTorch's ring attention, as the CUDA kernels are.

    PyTorch's context-parallel handlers cover the CUDA kernels (flash, efficient, cuDNN); SDPA on CPU calls
    _scaled_dot_product_flash_attention_for_cpu, which has the flash kernel's contract (it returns the output and
    the log-sum-exp, its backward takes them back), so the same ring attention runs it, unchanged.
    """
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    aten = torch.ops.aten

    def sharded(mesh: DeviceMesh, *tensors: torch.Tensor) -> tuple[DTensor, ...]:
        return tuple(DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in tensors)

    def forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DTensor, ...]:
        q, k, v = args[:3]
        is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        out, lse = _templated_ring_attention(
            q.device_mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu, q.to_local(),
            k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=0.0, scale=kwargs.get("scale"),
        )
        return sharded(q.device_mesh, out, lse)

    def backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DTensor, ...]:
        grad_out, q, k, v, out, lse, _, is_causal = args[:8]
        grads = _templated_ring_attention_backward(
            q.device_mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.to_local(), grad_out_name="grad_out", query=q.to_local(), key=k.to_local(),
            value=v.to_local(), out=out.to_local(), logsumexp=lse.to_local(), is_causal=is_causal, dropout_p=0.0,
            scale=kwargs.get("scale"),
        )
        return sharded(q.device_mesh, *grads[:3])

    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: backward,
    }


@contextlib.contextmanager
def sequence_split(cp_mesh: DeviceMesh, *buffers: torch.Tensor) -> Iterator[None]:
    """Run forward and backward of one micro-batch with its sequences split over the cp ranks.

    context_parallel keeps this rank's part of each buffer along dim 1, in place: 2 x CP chunks, rank r keeps
    chunks r and 2 x CP - 1 - r (causal load balancing: every rank does the same attention work), and routes
    F.scaled_dot_product_attention to ring attention (each rank's queries attend to every rank's keys and values).
    """
    with context_parallel(
        cp_mesh, buffers=list(buffers), buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        if cp_mesh.device_type == "cpu":
            DTensor._op_dispatcher._custom_op_handlers.update(cpu_ring_attention())
        yield
'''
