"""torch.ops.overlap_compile.moe_fused(buf, w1, w3, w2, group_name, plan) -> the combined slots
``[W * E_local * C, H]`` (what the section's combine all-to-all returned). Every device runs the
piece pipeline of reference.py (asynchronous functional collectives: NCCL on GPUs)."""
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
    from ...runtime.agreement import check_plan_agreement

    check_plan_agreement(group_name, plan, "moe_fused")
    return reference.run(buf, w1, w3, w2, group_name, p)


@moe_fused.register_fake
def _(buf, w1, w3, w2, group_name, plan):
    return buf.new_empty(buf.shape)
