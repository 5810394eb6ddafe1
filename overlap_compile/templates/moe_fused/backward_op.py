"""torch.ops.overlap_compile.moe_fused_backward(grad_buf, tokens_t, gate, up, act_t, w1t, w3t, w2t,
group_name, plan) -> [d_buf ``[W * E_local * C, H]`` (what the section's second all-to-all
returned), dw1, dw3 ``[E_local, H, F]``, dw2 ``[E_local, F, H]``]: the backward MoE section of a
training step (backward_reference.py says what each operand is).

Dispatch, as the forward's (dispatch.path): a ``"payload": "routed"`` plan runs
backward_reference.run_routed (routed.py's rounds, functional collectives or NCCL streams) but
under CUDA-graph capture; ``"transport": "p2p"`` where the copy engine can run it runs
backward_p2p.py; otherwise CUDA tensors on an NCCL group run backward_nccl.py; everything else
runs backward_reference.py. The plan must be a backward one (``MoePlan.direction``) by source.
Host-launched copy-engine calls can replay from per-site CUDA graphs (runtime.op_graphs) as the
forward's do, where ``spec.backward_host_replay`` is on (it is off: spec.py says why).
Registered when op.py is imported (the registry imports ``<template>.op``)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..base import LIB
from ..plans import MoePlan
from . import backward_reference, reference


def operand_shapes(p: MoePlan) -> dict[str, tuple[int, ...]]:
    e, wc, h, f = p.e_local, p.world * p.capacity, p.hidden, p.ffn
    return {"grad_buf": (p.world * p.e_local * p.capacity, h), "tokens_t": (e, h, wc), "gate": (e, wc, f),
            "up": (e, wc, f), "act_t": (e, f, wc), "w1t": (e, f, h), "w3t": (e, f, h), "w2t": (e, h, f)}


def check_plan(p: MoePlan) -> None:
    if p.direction != "backward" or not reference.by_source(p.config) \
            or p.config.get("experts") not in (None, "packed") \
            or p.config.get("transport", "nccl") not in ("nccl", "p2p") \
            or p.config.get("payload", "capacity") not in ("capacity", "routed"):
        raise ValueError(f"moe_fused_backward: needs a backward plan by source (direction 'backward', config "
                         f"{{'split': 'source'}}, optionally 'transport' 'nccl' or 'p2p', 'payload' 'routed' or "
                         f"'experts' 'packed'); "
                         f"got direction {p.direction!r}, config {p.config}")


@torch.library.custom_op(f"{LIB}::moe_fused_backward", mutates_args=())
def moe_fused_backward(grad_buf: torch.Tensor, tokens_t: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       act_t: torch.Tensor, w1t: torch.Tensor, w3t: torch.Tensor, w2t: torch.Tensor, group_name: str,
                       plan: str) -> list[torch.Tensor]:
    p = MoePlan.from_json(plan)
    check_plan(p)
    args = {"grad_buf": grad_buf, "tokens_t": tokens_t, "gate": gate, "up": up, "act_t": act_t, "w1t": w1t,
            "w3t": w3t, "w2t": w2t}
    want = operand_shapes(p)
    wrong = {k: tuple(t.shape) for k, t in args.items() if tuple(t.shape) != want[k]}
    if wrong:
        raise ValueError(f"moe_fused_backward: operands {wrong} do not match the plan ({ {k: want[k] for k in wrong} })")
    from ...runtime.agreement import check_plan_agreement

    check_plan_agreement(group_name, plan, "moe_fused_backward")
    grad_buf = grad_buf.contiguous()  # the pieces are views of its rows
    from .dispatch import path, replayable, run_replayed

    how = path(group_name, grad_buf.device, p)
    operands = (grad_buf, tokens_t, gate, up, act_t, w1t, w3t, w2t)
    if how == "p2p" and replayable("backward"):
        from . import backward_p2p

        outs = _new_outputs(grad_buf, gate, p)
        return run_replayed(group_name, plan, operands, outs,
                            lambda: backward_p2p.run(*operands, group_name, p, outs=outs))
    if how == "routed":
        return backward_reference.run_routed(*operands, group_name, p)
    if how == "p2p":
        from . import backward_p2p as impl
    elif how == "nccl":
        from . import backward_nccl as impl
    else:
        impl = backward_reference
    return impl.run(*operands, group_name, p)


def _new_outputs(grad_buf: torch.Tensor, gate: torch.Tensor, p: MoePlan) -> list[torch.Tensor]:
    """d_buf, dw1, dw3, dw2."""
    e, h, f = p.e_local, p.hidden, p.ffn
    return [grad_buf.new_empty(grad_buf.shape), gate.new_empty(e, h, f), gate.new_empty(e, h, f),
            gate.new_empty(e, f, h)]


@moe_fused_backward.register_fake
def _(grad_buf, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name, plan):
    return _new_outputs(grad_buf, gate, MoePlan.from_json(plan))


# where each operand's slots run (the axis of W * E * C or W * C rows), for zero_past_fill
SLOT_DIMS = {"grad_buf": 0, "tokens_t": 2, "gate": 1, "up": 1, "act_t": 2}


def measured_call(match: Any, plan: MoePlan | None, rnd: Callable[..., torch.Tensor],
                  fill: float = 1.0) -> Callable[[], Any]:
    """What exhaustive search times for a backward section (predictor/exhaustive.py): the section
    as written (``plan`` None: backward_reference.run_as_written) or this op under ``plan``, on
    random operands of the section's shapes (``rnd(*shape)``), the gradient and the saved slots
    zero past ``fill`` of each expert's capacity, as the layer's are past its routed rows."""
    p = plan or MoePlan("moe_fused", match.world_size, match.e_local, match.capacity, match.hidden, match.ffn,
                        {"split": "source"}, direction="backward")
    operands = [rnd(*shape) for shape in operand_shapes(p).values()]
    for t, name in zip(operands, operand_shapes(p)):
        if name in SLOT_DIMS:
            reference.zero_past_fill(t, SLOT_DIMS[name], p.capacity, fill)
    if plan is None:
        return lambda: backward_reference.run_as_written(*operands, match.group_name, p)
    text = plan.to_json()
    return lambda: torch.ops.overlap_compile.moe_fused_backward.default(*operands, match.group_name, text)
