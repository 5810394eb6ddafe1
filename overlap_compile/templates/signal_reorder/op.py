"""torch.ops.overlap_compile.signal_reorder_gemm_collective(a, b, bias, group_name, plan) -> tile buffer.

Returns the *received* tile buffer in slot order (reference.out_shape); the graph glue emitted by
spec.SignalReorderSpec.emit_gemm_collective turns it back into rows.
"""
from __future__ import annotations

from ..base import define_gemm_collective_op
from . import reference


def _cuda(a, b, bias, group_name, plan):
    from . import kernels

    if kernels.available() and not reference.is_subtile(plan):  # no GPU kernel for the subtile form yet
        return kernels.run(a, b, bias, group_name, plan)
    return reference.run(a, b, bias, group_name, plan)


signal_reorder_gemm_collective = define_gemm_collective_op(
    "signal_reorder", reference.out_shape, reference.run, cuda=_cuda
)
