"""torch.ops.overlap_compile.p2p_ring_gemm_collective(a, b, bias, group_name, plan) -> [result_rows, n]
and torch.ops.overlap_compile.p2p_ring_allgather_gemm(shard, bs, biases, group_name, plan)
-> [gathered, y_0, y_1, ...].

The gemm-collective op returns the collective's result rows directly (reduce-scatter: my reduced
stripe; all-to-all: the received blocks in source order), so the graph needs no glue beyond the
view that spec's base emitter already adds. Every device runs the reference ring for now (no GPU
kernels yet): it is the same decomposed algorithm, with real asynchronous P2P transfers.
"""
from __future__ import annotations

from ..base import define_allgather_gemm_op, define_gemm_collective_op
from . import reference

p2p_ring_gemm_collective = define_gemm_collective_op("p2p_ring", reference.out_shape, reference.run, cuda=None)
p2p_ring_allgather_gemm = define_allgather_gemm_op("p2p_ring", reference.run_allgather, cuda=None)
