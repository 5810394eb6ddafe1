"""torch.ops.overlap_compile.moe_fused(buf, w1, w3, w2, group_name, plan) -> [the combined slots
``[W * E_local * C, H]`` (what the section's combine all-to-all returned), then the intermediates
``plan.saves`` names (training graphs: what backward reads), each ``[E_local, W * C, H|F]``].

Dispatch (``path``): ``"payload": "routed"`` runs routed.py (not under CUDA-graph capture); CUDA
with ``"transport": "p2p"`` and symmetric memory runs kernels.py; other CUDA on NCCL runs
kernels_nccl.py; everything else reference.py. Host-launched copy-engine calls with bmm or packed
experts replay through runtime.op_graphs where ``spec.host_replay`` is on (packed sizes are
computed on the device, so a replay finds new sizes); the persistent expert kernel is not replayed."""
from __future__ import annotations

import torch

from ..base import LIB
from ..plans import MoePlan
from .dispatch import path, replayable, run_replayed  # path: which implementation runs (also read as op.path)
from . import backward_op  # noqa: F401  (registers moe_fused_backward: the registry imports op.py)
from . import scatter  # noqa: F401  (registers moe_scatter_rows, which passes/moe_scatter.py emits)
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
    if where == "p2p" and p.config.get("experts", "bmm") != "fused" and replayable():
        outs = _new_outputs(buf, p)
        return run_replayed(group_name, plan, (buf, w1, w3, w2), outs,
                            lambda: impl.run(buf, w1, w3, w2, group_name, p, outs=outs))
    got = impl.run(buf, w1, w3, w2, group_name, p)
    return got if isinstance(got, list) else [got]


def _new_outputs(buf: torch.Tensor, p: MoePlan) -> list[torch.Tensor]:
    """The combined slots, then the intermediates ``p.saves`` names."""
    return [buf.new_empty(buf.shape)] + [buf.new_empty(p.e_local, p.world * p.capacity,
                                                       p.hidden if role == "tokens" else p.ffn) for role in p.saves]


@moe_fused.register_fake
def _(buf, w1, w3, w2, group_name, plan):
    return _new_outputs(buf, MoePlan.from_json(plan))
