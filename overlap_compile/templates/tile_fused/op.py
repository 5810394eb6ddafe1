"""torch.ops.overlap_compile.tile_fused_gemm_collective(a, b, bias, group_name, plan) -> [result_rows, n]
and torch.ops.overlap_compile.tile_fused_allgather_gemm(shard, bs, biases, group_name, plan)
-> [gathered, y_0, y_1, ...].

Dispatch: CUDA tensors on an NCCL group whose ranks share a node with peer access (symmetric
memory) run kernels.py; everything else (CPU / gloo, no peer access, no Triton) runs
reference.py, the same tile schedule with point-to-point messages.
"""
from __future__ import annotations

from ..base import define_allgather_gemm_op, define_gemm_collective_op, kernels_or_reference
from . import reference

_route, _route_allgather = kernels_or_reference(__package__, reference,
                                                errors_check="check_errors")

tile_fused_gemm_collective = define_gemm_collective_op("tile_fused", reference.out_shape, reference.run, route=_route)
tile_fused_allgather_gemm = define_allgather_gemm_op("tile_fused", reference.run_allgather, route=_route_allgather)
