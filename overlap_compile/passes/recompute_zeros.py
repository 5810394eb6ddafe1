"""A joint-graph pass: the zeros an accumulating index_put / index_add starts from are recomputed
where they are read, never saved for backward. AOTAutograd's partitioner saves the forward's
``full([rows, H], 0)`` and hands it to the backward as an input, so moe_scatter cannot prove the
backward's buffer starts from zeros. Before::

    def backward(..., full_default, ..., tangents_1):
        index_put_1 = index_put(full_default, [slot], grad_rows, True)   # full_default: a placeholder

After (marked ``MUST_RECOMPUTE``, the selective activation checkpointing policy)::

    def backward(..., tangents_1):
        full_default = full([rows, H], 0)
        index_put_1 = index_put(full_default, [slot], grad_rows, True)

Run as Inductor's ``joint_custom_post_pass`` where moe_scatter is on (inductor_hook.RecomputeZerosPass).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import is_zero_fill

aten = torch.ops.aten


def accumulated_zeros(graph: fx.Graph) -> list[fx.Node]:
    """Zero fills that are the base of an accumulating index_put or of an index_add."""
    out = []
    for n in graph.nodes:
        if n.op != "call_function" or not n.args:
            continue
        accumulates = ((n.target is aten.index_put.default and len(n.args) > 3 and n.args[3] is True)
                       or n.target is aten.index_add.default)
        if accumulates and is_zero_fill(n.args[0]):
            out.append(n.args[0])
    return list(dict.fromkeys(out))


def mark_zeros_for_recompute(graph: fx.Graph) -> int:
    """Mark every accumulated-into zero fill MUST_RECOMPUTE; how many were marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    nodes = accumulated_zeros(graph)
    for n in nodes:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(nodes)
