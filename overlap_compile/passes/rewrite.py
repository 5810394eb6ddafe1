"""rewrite: apply decisions to the graph. Never decides: a Decision says what to do.

GEMM -> collective sites::

    mm -> views [-> split/cat] -> collective -> wait -> users
 becomes
    <template op>(a, b, bias, group, plan) [-> template glue] -> view(wait's shape) -> users

All-gather -> GEMM sites::

    shard -> all_gather -> wait [-> split/cat] -> view [M, K] -> mm_i(., b_i) -> users_i
 becomes
    <template op>(view(shard, [M/W, K]), [b_i], [bias_i], group, plan) -> (gathered, y_0, y_1, ...)
    gathered -> the other users of the [M, K] matrix (none: plan ``gathered: false``, unwritten)
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import templates
from .decide import Decision
from .graph_utils import GraphEmitter, after_inputs, aten, erase_if_dead, static_shape
from .matches import AllGatherGemmMatch, GemmThenCollective, MoeBackwardMatch, MoeSectionMatch
from .rewrite_moe_backward import rewrite_moe_backward


def rewrite(graph: fx.Graph, decisions: list[Decision], timeout_ms: int, replay_written: bool = False,
            replay_kept: dict | None = None) -> int:
    """Apply every rewriting decision; return how many sites were rewritten. ``replay_written``:
    symbolic sites' "as written" buckets run as an op that op graphs replay (templates/bucketed.py);
    ``replay_kept``: id(match) -> plan of the kept sites run as that op (passes/replay_kept.py),
    not counted."""
    done = 0
    for d in decisions:
        if not d.rewrites:
            plan = (replay_kept or {}).get(id(d.match))
            if plan is not None:
                _rewrite_site(graph, d.match, templates.get_spec(plan.template), plan)
            continue
        if getattr(d.match, "rows", None) is not None:  # symbolic row count (passes/symbolic_rewrite.py)
            from .symbolic_rewrite import rewrite_bucketed

            rewrite_bucketed(graph, d, timeout_ms, _rewrite_allgather_gemm, replay_written)
            done += 1
            continue
        spec = templates.get_spec(d.template)
        _rewrite_site(graph, d.match, spec, spec.plan(d.match, d.config, timeout_ms))
        done += 1
    if done or replay_kept:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.lint()
    return done


def _rewrite_site(graph: fx.Graph, match, spec, plan) -> None:
    if isinstance(match, AllGatherGemmMatch):
        _rewrite_allgather_gemm(graph, spec, match, plan)
    elif isinstance(match, MoeBackwardMatch):  # before its base class, MoeSectionMatch
        rewrite_moe_backward(graph, match, plan, after_inputs)
    elif isinstance(match, MoeSectionMatch):
        _rewrite_moe(graph, match, plan)
    else:
        _rewrite_gemm_collective(graph, spec, match, plan)


def _rewrite_gemm_collective(graph: fx.Graph, spec, m: GemmThenCollective, plan) -> None:
    emit = GraphEmitter(graph, before=after_inputs(graph, m.operand_nodes()))
    rows = spec.emit_gemm_collective(emit, m, plan)
    result = emit(aten.view.default, rows, list(static_shape(m.wait_node)))
    m.wait_node.replace_all_uses_with(result)
    erase_if_dead(graph, [m.wait_node, m.collective_node, *m.chain_nodes, m.mm_node, *[t[0] for t in m.extra_terms]])
    if plan.config.get("rs_layout") == "subtile":
        _fix_rows_after_allgather(graph, m, plan)


def _fix_rows_after_allgather(graph: fx.Graph, m: GemmThenCollective, plan) -> None:
    """Subtile reduce-scatter: rows reached the ranks in subtile order, went through row-wise ops
    unchanged, and were all-gathered; put them back in order right after that all-gather."""
    from ..tiling import subtile_fix

    wait = m.subtile_ag_wait
    readers = list(wait.users)
    fixed = subtile_fix(wait, plan.m, static_shape(wait)[-1], plan.config["block_m"], plan.world,
                        GraphEmitter(graph, before=wait.next))
    for user in readers:
        user.replace_input_with(wait, fixed)


def _rewrite_allgather_gemm(graph: fx.Graph, spec, m: AllGatherGemmMatch, plan) -> None:
    from .symbolic_sizes import read_sizes_from_inputs

    for node in {m.full_node, m.gathered_node, *m.gathered_twins}:
        read_sizes_from_inputs(graph, node)
    inputs = [m.shard_node] + [c.b_node for c in m.consumers] + [c.bias_node for c in m.consumers if c.bias_node]
    emit = GraphEmitter(graph, before=after_inputs(graph, inputs))
    outs = spec.emit_allgather_gemm(emit, m, plan)
    gathered, ys = outs[0], outs[1:]
    for c, y in zip(m.consumers, ys):
        c.mm_node.replace_all_uses_with(y)
    erase_if_dead(graph, [c.mm_node for c in m.consumers])
    for view in (m.gathered_node, *m.gathered_twins):
        view.replace_all_uses_with(gathered)
    others = [u for u in m.full_node.users if u not in m.chain_nodes]
    if m.full_node is not m.gathered_node and others:
        # The un-flattened gathered tensor (e.g. [B, S, H]) has readers besides the flattening views.
        unflat = GraphEmitter(graph, before=gathered.next)(aten.view.default, gathered, list(m.gathered_shape))
        for user in others:
            user.replace_input_with(m.full_node, unflat)
    erase_if_dead(graph, [*m.chain_nodes, m.wait_node, m.ag_node])
    if not gathered.users:  # only the GEMMs read the gathered rows: the op need not write them out
        op = gathered.args[0]
        op.args = (*op.args[:-1], dataclasses.replace(plan, gathered=False).to_json())
        graph.erase_node(gathered)


def _rewrite_moe(graph: fx.Graph, m: MoeSectionMatch, plan) -> None:
    """dispatch all-to-all ... combine's wait -> one moe_fused op on the dispatch buffer."""
    import torch

    import operator

    emit = GraphEmitter(graph, before=after_inputs(graph, [m.buffer_node, *m.weight_nodes]))
    outs = emit(torch.ops.overlap_compile.moe_fused.default, m.buffer_node, *m.weight_nodes, m.group_name,
                plan.to_json())
    m.combine_wait.replace_all_uses_with(emit(operator.getitem, outs, 0))
    # a training section's intermediates that backward reads: the op's further outputs
    for i, role in enumerate(plan.saves, start=1):
        m.saved_nodes[role].replace_all_uses_with(emit(operator.getitem, outs, i))
    erase_if_dead(graph, [m.combine_wait, *reversed(m.section_nodes), m.dispatch_node])
