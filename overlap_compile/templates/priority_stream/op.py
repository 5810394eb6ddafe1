"""torch.ops.overlap_compile.priority_stream_gemm_collective(a, b, bias, group_name, plan) -> [result_rows, n]
and torch.ops.overlap_compile.priority_stream_allgather_gemm(shard, bs, biases, group_name, plan)
-> [gathered, y_0, y_1, ...].

Dispatch: CUDA tensors on an NCCL group run kernels.py (chunks on the compute stream, collectives
on a high-priority stream, ordered by events); everything else runs reference.py, the same chunk
schedule with asynchronous functional collectives.
"""
from __future__ import annotations

from ..base import define_allgather_gemm_op, define_gemm_collective_op, kernels_or_reference
from . import reference

_route, _route_allgather = kernels_or_reference(__package__, reference,
                                                errors_check=None)

priority_stream_gemm_collective = define_gemm_collective_op(
    "priority_stream", reference.out_shape, reference.run, route=_route
)
priority_stream_allgather_gemm = define_allgather_gemm_op("priority_stream", reference.run_allgather,
                                                          route=_route_allgather)
