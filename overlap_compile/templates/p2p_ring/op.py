"""torch.ops.overlap_compile.p2p_ring_gemm_collective(a, b, bias, group_name, plan) -> [result_rows, n]
and torch.ops.overlap_compile.p2p_ring_allgather_gemm(shard, bs, biases, group_name, plan)
-> [gathered, y_0, y_1, ...].

The gemm-collective op returns the collective's result rows directly (reduce-scatter: my reduced
stripe; all-to-all: the received blocks in source order), so the graph needs no glue beyond the
view that spec's base emitter already adds. CUDA tensors with transport "p2p" (row stripes, one
node) run kernels.py (copy-engine peer copies over symmetric memory; not yet run on a GPU);
everything else runs the reference ring: the same decomposed algorithm, with real asynchronous
P2P transfers.
"""
from __future__ import annotations

from ..base import define_allgather_gemm_op, define_gemm_collective_op
from . import reference

def _cuda(a, b, bias, group_name, plan):
    from . import kernels

    if plan.kind == "gemm_reducescatter" and kernels.usable(group_name, a.device, plan) is None:
        return kernels.run_reducescatter(a, b, bias, group_name, plan)
    return reference.run(a, b, bias, group_name, plan)


def _cuda_allgather(shard, bs, biases, group_name, plan):
    from . import kernels

    if kernels.usable(group_name, shard.device, plan) is None:
        return kernels.run_allgather(shard, bs, biases, group_name, plan)
    return reference.run_allgather(shard, bs, biases, group_name, plan)


p2p_ring_gemm_collective = define_gemm_collective_op("p2p_ring", reference.out_shape, reference.run, cuda=_cuda)
p2p_ring_allgather_gemm = define_allgather_gemm_op("p2p_ring", reference.run_allgather, cuda=_cuda_allgather)
