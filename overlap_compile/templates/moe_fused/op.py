"""torch.ops.overlap_compile.moe_fused(buf, w1, w3, w2, group_name, plan) -> the combined slots
``[W * E_local * C, H]`` (what the section's combine all-to-all returned).

Dispatch: CUDA tensors on an NCCL group run kernels.py (pieces' all-to-alls on a high-priority
stream, experts on the compute stream, events); everything else runs reference.py, the same
piece pipeline with asynchronous functional collectives."""
from __future__ import annotations

import torch

from ..base import LIB
from ..plans import MoePlan
from . import reference


@torch.library.custom_op(f"{LIB}::moe_fused", mutates_args=())
def moe_fused(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
              plan: str) -> torch.Tensor:
    p = MoePlan.from_json(plan)
    want = (p.world * p.e_local * p.capacity, p.hidden)
    if tuple(buf.shape) != want or tuple(w1.shape) != (p.e_local, p.hidden, p.ffn):
        raise ValueError(f"moe_fused: dispatch buffer {tuple(buf.shape)} / w1 {tuple(w1.shape)} do not match the plan "
                         f"(buffer {want}, w1 {(p.e_local, p.hidden, p.ffn)})")
    if tuple(w3.shape) != (p.e_local, p.hidden, p.ffn) or tuple(w2.shape) != (p.e_local, p.ffn, p.hidden):
        raise ValueError(f"moe_fused: w3 {tuple(w3.shape)} / w2 {tuple(w2.shape)} do not match the plan "
                         f"(w3 {(p.e_local, p.hidden, p.ffn)}, w2 {(p.e_local, p.ffn, p.hidden)})")
    from ...runtime.agreement import check_plan_agreement

    check_plan_agreement(group_name, plan, "moe_fused")
    buf = buf.contiguous()  # the pieces are views of its rows
    if buf.is_cuda:
        from . import kernels

        if kernels.usable(group_name, buf.device):
            return kernels.run(buf, w1, w3, w2, group_name, p)
    return reference.run(buf, w1, w3, w2, group_name, p)


@moe_fused.register_fake
def _(buf, w1, w3, w2, group_name, plan):
    return buf.new_empty(buf.shape)
