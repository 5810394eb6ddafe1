"""torch.ops.overlap_compile.moe_fused(buf, w1, w3, w2, group_name, plan) -> [the combined slots
``[W * E_local * C, H]`` (what the section's combine all-to-all returned), then the intermediates
``plan.saves`` names (training graphs: what backward reads), each ``[E_local, W * C, H|F]``].

Dispatch (``path``): a ``"payload": "routed"`` plan runs routed.py (only the routed rows travel
and meet the experts) on any device, but under CUDA-graph capture (it reads sizes on the host);
CUDA tensors with a ``"transport": "p2p"`` plan and symmetric memory run
kernels.py (copy-engine pieces); other CUDA tensors on an NCCL group run kernels_nccl.py
(pieces' all-to-alls on a high-priority stream); everything else runs reference.py, the same
piece pipeline with asynchronous functional collectives."""
from __future__ import annotations

import torch

from ..base import LIB
from ..plans import MoePlan
from .dispatch import path  # which implementation a call runs (also read as op.path)
from . import backward_op  # noqa: F401  (registers moe_fused_backward: the registry imports op.py)
from . import reference


@torch.library.custom_op(f"{LIB}::moe_fused", mutates_args=())
def moe_fused(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
              plan: str) -> list[torch.Tensor]:
    p = MoePlan.from_json(plan)
    if p.direction != "forward":
        raise ValueError(f"moe_fused: a {p.direction!r} plan; the backward section runs moe_fused_backward")
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
    where = path(group_name, buf.device, p)
    if where == "routed":
        from . import routed as impl
    elif where == "p2p":
        from . import kernels as impl
    elif where == "nccl":
        from . import kernels_nccl as impl
    else:
        impl = reference
    got = impl.run(buf, w1, w3, w2, group_name, p)
    return got if isinstance(got, list) else [got]


@moe_fused.register_fake
def _(buf, w1, w3, w2, group_name, plan):
    p = MoePlan.from_json(plan)
    saved = [buf.new_empty(p.e_local, p.world * p.capacity, p.hidden if role == "tokens" else p.ffn)
             for role in p.saves]
    return [buf.new_empty(buf.shape), *saved]
