"""torch.ops.overlap_compile.p2p_ring_gemm_collective(a, b, bias, group_name, plan) -> [result_rows, n]
and torch.ops.overlap_compile.p2p_ring_allgather_gemm(shard, bs, biases, group_name, plan)
-> [gathered, y_0, y_1, ...]. The gemm-collective op returns the collective's result rows in its
order (no glue beyond the base emitter's view).

Dispatch (``path``, on a site's first call): CUDA on NCCL runs kernels.py when the transport is
"p2p" and symmetric memory is usable (host-launched calls replay via runtime.op_graphs), else
kernels_nccl.py; everything else (CPU / gloo, other configs) runs reference.py.
"""
from __future__ import annotations

from ..base import Route, define_allgather_gemm_op, define_gemm_collective_op
from . import reference


def path(group_name: str, device, plan) -> str:
    """Which implementation a call runs: "p2p" (kernels.py), "nccl" (kernels_nccl.py) or
    "reference"."""
    from . import kernels, kernels_nccl

    if plan.config.get("transport") == "p2p" and kernels.usable(group_name, device, plan) is None:
        return "p2p"
    if kernels_nccl.usable(group_name, device, plan) is None:
        return "nccl"
    return "reference"


def _route_for(entry: str):
    def route(group_name, device, plan) -> Route:
        from . import kernels, kernels_nccl

        where = path(group_name, device, plan)
        if where == "p2p":
            return Route(getattr(kernels, entry), graphable=True,
                         check_errors=lambda: kernels.check_errors(device, synchronize=False))
        return Route(getattr(kernels_nccl if where == "nccl" else reference, entry))

    return route


p2p_ring_gemm_collective = define_gemm_collective_op("p2p_ring", reference.out_shape, reference.run,
                                                     route=_route_for("run"))
p2p_ring_allgather_gemm = define_allgather_gemm_op("p2p_ring", reference.run_allgather,
                                                   route=_route_for("run_allgather"))
