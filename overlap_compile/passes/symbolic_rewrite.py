"""rewrite of a site whose row count M is symbolic: one call of the bucketed op (templates/
bucketed.py) carrying the decision's bucket table.

GEMM -> collective::

    mm -> views [-> split/cat] -> collective -> wait -> users
 becomes
    bucketed_gemm_collective(a, b, bias, group, table) [-> view(wait's shape)] -> users

All-gather -> GEMM sites go through rewrite._rewrite_allgather_gemm (handed down) with an emitter for the
bucketed op. (Host-launched, calls at M every rewritten site runs as written go to torch.compile's
own graph: row_dispatch.py.) Symbolic view sizes are graph nodes (symbolic_sizes.size_arg): the shapes of the
new nodes are the same expressions as those they replace, so nothing new is guarded.
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from ..templates.base import gemm_operands
from ..templates.bucketed import BucketTable, bucketed_allgather_gemm, bucketed_gemm_collective
from . import symbolic_sizes as ss
from .graph_utils import GraphEmitter, after_inputs, aten, erase_if_dead
from .matches import AllGatherGemmMatch


def table_of(d, timeout_ms: int, replay_written: bool = False) -> BucketTable:
    m = d.match
    rows = m.rows
    entries = tuple(dict(e) for e in d.table)
    if isinstance(m, AllGatherGemmMatch):
        return BucketTable(kind=m.kind, world=m.world_size, k=m.k, ns=tuple(c.n for c in m.consumers),
                           has_bias=tuple(c.bias_node is not None for c in m.consumers), outer=rows.outer,
                           chunk=rows.chunk, buckets=entries, timeout_ms=timeout_ms, replay_written=replay_written)
    return BucketTable(kind=m.kind, world=m.world_size, k=m.k, n=m.n, reduce_op=m.reduce_op,
                       has_bias=m.bias_node is not None, outer=rows.outer, chunk=rows.chunk, buckets=entries,
                       timeout_ms=timeout_ms, replay_written=replay_written)


def rewrite_bucketed(graph: fx.Graph, d, timeout_ms: int, rewrite_allgather_gemm, replay_written: bool = False) -> None:
    """``rewrite_allgather_gemm``: rewrite._rewrite_allgather_gemm, handed down (this module sits
    below rewrite.py); ``replay_written``: BucketTable.replay_written."""
    table = table_of(d, timeout_ms, replay_written)
    if isinstance(d.match, AllGatherGemmMatch):
        match = dataclasses.replace(d.match)  # its gathered_shape becomes view arguments (the emitter's)
        rewrite_allgather_gemm(graph, _AllGatherEmitter(), match, table)
        return
    m = d.match
    emit = GraphEmitter(graph, before=after_inputs(graph, m.operand_nodes()))
    a, b = gemm_operands(emit, m)
    rows = emit(bucketed_gemm_collective, a, b, m.bias_node, m.group_name, table.to_json())
    result = rows
    if len(m.rows.view) != 2:
        at = GraphEmitter(graph, before=m.wait_node)
        result = at(aten.view.default, rows, [ss.size_arg(m.wait_node, s, at) for s in m.rows.view])
    m.wait_node.replace_all_uses_with(result)
    erase_if_dead(graph, [m.wait_node, m.collective_node, *m.chain_nodes, m.mm_node, *[t[0] for t in m.extra_terms]])


class _AllGatherEmitter:
    """The spec-like emitter rewrite._rewrite_allgather_gemm calls: the shard flattened to
    [M / W, K], the bucketed op, its outputs; it also turns the match's gathered_shape into view arguments built at the same place
    (the un-flattening view, where the graph reads one)."""

    def emit_allgather_gemm(self, emit, match: AllGatherGemmMatch, table: BucketTable) -> list[fx.Node]:
        before = emit.before
        shard_shape = tuple(match.shard_node.meta["val"].shape)
        shard = match.shard_node
        if len(shard_shape) != 2:
            local_rows = 1
            for s in shard_shape[:-1]:
                local_rows = local_rows * s
            shard = emit(aten.reshape.default, shard, [ss.size_arg(before, local_rows, emit), match.k])
        if match.full_node is not match.gathered_node and any(u not in match.chain_nodes
                                                               for u in match.full_node.users):
            match.gathered_shape = tuple(ss.size_arg(before, s, emit) for s in match.rows.view)
        out = emit(bucketed_allgather_gemm, shard, [c.b_node for c in match.consumers],
                   [c.bias_node for c in match.consumers], match.group_name, table.to_json())
        return [emit(operator.getitem, out, i) for i in range(1 + len(match.consumers))]
