"""moe_fused_backward on NVIDIA GPUs over NCCL: backward_reference.py's pipeline by source on
CUDA streams (kernels_nccl.rounds_by_source, the forward's rounds):

    comm stream     gradient pieces 1 .. W-1 back to back (an event after each), then d_h piece r
                    once the compute stream's event "d_h r done" has fired
    compute stream  d_h of the own slots (no transfer), d_h of piece r after its event, then the
                    three weight-gradient GEMMs over all rows while the last d_h pieces travel
    join            the compute stream waits for the comm stream before the op returns

GPU profiles offer the copy-engine backward only (backward_spec.py), this path by force_config.
"""
from __future__ import annotations

import torch

from ..plans import MoePlan
from . import backward_reference as bref
from . import kernels_nccl


def run(grad_buf: torch.Tensor, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name: str,
        plan: MoePlan) -> list[torch.Tensor]:
    from ...runtime.comm import resolve_group

    pg = resolve_group(group_name)
    if pg.size() != plan.world:
        raise ValueError(f"moe_fused_backward: group {group_name!r} has {pg.size()} ranks, the plan was made for "
                         f"{plan.world}")
    w, rows, h = plan.world, plan.e_local * plan.capacity, plan.hidden
    slots, out = grad_buf.view(w, rows, h), grad_buf.new_empty(w, rows, h)
    pieces = bref.make_pieces(slots, out, pg.rank(), plan, tokens_t, gate, up, act_t, w1t, w3t, w2t)
    kernels_nccl.rounds_by_source(slots, out, pg, torch.cuda.current_stream(grad_buf.device),
                                  kernels_nccl.comm_stream(grad_buf.device), pieces.own, pieces.peer, pieces.after)
    return pieces.result()
