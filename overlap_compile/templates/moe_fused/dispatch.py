"""Which implementation a moe_fused call runs, either direction (op.py's forward,
backward_op.py's backward): one answer for both, so a plan's config means the same path."""
from __future__ import annotations

import torch

from ..plans import MoePlan


def path(group_name: str, device: torch.device, plan: MoePlan) -> str:
    """Which implementation a call runs: "routed" (routed.py, only the routed rows: any device, not
    under CUDA-graph capture), "p2p" (kernels.py, copy engine), "nccl" (kernels_nccl.py, CUDA
    streams) or "reference" (CPU, or no usable GPU path)."""
    from .routed import runs_routed

    if runs_routed(plan.config, device):
        return "routed"  # under CUDA-graph capture (no host synchronisation): the capacity pipeline
    if device.type != "cuda":
        return "reference"
    from . import kernels, kernels_nccl

    if plan.config.get("transport") == "p2p" and kernels.usable(group_name, device, plan) is None:
        return "p2p"
    if kernels_nccl.usable(group_name, device, plan) is None:
        return "nccl"
    return "reference"


def replayable(direction: str = "forward") -> bool:
    """Whether host-launched copy-engine calls (bmm experts) of ``direction`` go through
    runtime.op_graphs: where the op_graphs option is on and the spec says that direction's path
    replays (``spec.replays``)."""
    from ... import config
    from .spec import SPEC

    return config.current().op_graphs and SPEC.replays(direction)


def run_replayed(group_name: str, plan: str, inputs: tuple, outs: list[torch.Tensor], call) -> list[torch.Tensor]:
    """A copy-engine call, either direction, through runtime.op_graphs: ``call()`` is stream work
    only (kernels.py, backward_p2p.py) writing into ``outs``, which the op allocated before the
    lookup, so a host-launched call with the same buffers replays it from a CUDA graph (one launch
    instead of the pipeline's dozens of host calls), as the other templates' ops do
    (base.define_gemm_collective_op)."""
    from ...runtime import op_graphs
    from . import kernels

    device = inputs[0].device
    op_graphs.run((kernels.TEMPLATE, group_name, plan), device, inputs, outs, call,
                  lambda: kernels.check_errors(device, synchronize=False))
    return outs
