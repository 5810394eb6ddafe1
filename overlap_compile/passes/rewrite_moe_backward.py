"""rewrite for a backward MoE section (matches.MoeBackwardMatch)::

    a2a(grad_buf) ... d_act, d_up, d_gate, d_h, dw1, dw3, dw2 ... a2a(d_h); wait -> users
 becomes
    outs = overlap_compile.moe_fused_backward(grad_buf, tokens_t, gate, up, act_t, w1t, w3t, w2t, group, plan)
    outs[0] -> the readers of the second all-to-all's wait; outs[1..3] -> the readers of the dw1,
    dw3, dw2 bmm (their views, if any, stay: the op returns each in its bmm's layout)

The op reads every operand the section's bmm read, as they read it (transposed saved tensors and
weights); nodes of the old section are erased once nothing reads them.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from .graph_utils import GraphEmitter, erase_if_dead
from .matches import MoeBackwardMatch

OPERANDS = ("tokens_t", "gate", "up", "act_t", "w1t", "w3t", "w2t")  # moe_fused_backward's order


def rewrite_moe_backward(graph: fx.Graph, m: MoeBackwardMatch, plan,
                         after_inputs: Callable[[fx.Graph, list[fx.Node]], fx.Node]) -> None:
    """``after_inputs(graph, nodes)``: the node right after the last of ``nodes`` (rewrite.py's),
    where the op goes."""
    operands = [m.buffer_node, *[m.inputs[k] for k in OPERANDS]]
    emit = GraphEmitter(graph, before=after_inputs(graph, operands))
    outs = emit(torch.ops.overlap_compile.moe_fused_backward.default, *operands, m.group_name, plan.to_json())
    m.combine_wait.replace_all_uses_with(emit(operator.getitem, outs, 0))
    for i, grad in enumerate(m.weight_grad_nodes(), start=1):
        grad.replace_all_uses_with(emit(operator.getitem, outs, i))
    erase_if_dead(graph, [m.combine_wait, *reversed(m.section_nodes), m.dispatch_node])
