"""torch.ops.overlap_compile.signal_reorder_gemm_collective(a, b, bias, group_name, plan) -> tile buffer.

Returns the *received* tile buffer in slot order (reference.out_shape); the graph glue emitted by
spec.SignalReorderSpec.emit_gemm_collective turns it back into rows.
"""
from __future__ import annotations

from ..base import Route, define_gemm_collective_op
from . import reference


def _route(group_name, device, plan) -> Route:
    from . import kernels

    if kernels.available() and not reference.is_subtile(plan):  # no GPU kernel for the subtile form yet
        return Route(kernels.run, graphable=True, check_errors=lambda: kernels.check_errors(device, synchronize=False))
    return Route(reference.run)


signal_reorder_gemm_collective = define_gemm_collective_op(
    "signal_reorder", reference.out_shape, reference.run, route=_route
)
