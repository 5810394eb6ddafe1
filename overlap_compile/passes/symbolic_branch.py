"""Host-launched graphs: the M ranges a symbolic site's table runs "as written" run the site in
Inductor's own code, without the bucketed op.

A bucketed op is a Python kernel behind the dispatcher. In a host-launched graph every call pays
that dispatch and Python before it queues a kernel, and at decode-sized M the call is host-bound
while the table says "as written" anyway: that host time is what decode loses to torch.compile.
Where a table has both "as written" buckets and buckets that rewrite, the op becomes a branch
that Inductor writes into its wrapper as a Python ``if``::

    out = bucketed_op(operands, group, table)
 becomes
    out = cond(M in the as-written ranges, as_written(operands), bucketed(operands))
    e.g. cond((M <= 256) | (M > 4096), ...) for a table "as written" up to 256 and past 4096

``as_written`` is the site's GEMM then its functional collective, lowered by Inductor as it lowers
the graph as written; ``bucketed`` calls the op. Only where the option ``decode_as_written`` is
on and the graph is host-launched (Inductor captures no CUDA graph holding a cond, and a replay
costs no host time anyway); sites whose row stripes are off the leading dim (outer > 1) and
all-to-all sites keep the op alone.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..templates.bucketed import BASELINE, BucketTable
from . import symbolic_sizes as ss

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def as_written_ranges(table: BucketTable) -> list[tuple[int, int | None]]:
    """The M ranges (lo, hi) the table runs "as written" (lo 1 for the first; hi None: no end),
    neighbours merged; [] where every bucket is as written or none is (no op to avoid, or
    nothing to branch to)."""
    ranges: list[tuple[int, int | None]] = []
    prev = 0
    for entry in table.buckets:
        if entry["template"] == BASELINE:
            if ranges and ranges[-1][1] == prev:
                ranges[-1] = (ranges[-1][0], entry["max_m"])
            else:
                ranges.append((prev + 1, entry["max_m"]))
        if entry["max_m"] is None:
            break
        prev = entry["max_m"]
    return [] if ranges == [(1, None)] else ranges


def applies(table: BucketTable) -> bool:
    """Whether a site with this table gets the branch (the graph being host-launched)."""
    from ..predictor import launch_mode

    if launch_mode() != "eager" or table.kind == "gemm_alltoall" or table.outer not in (None, 1):
        return False
    return bool(as_written_ranges(table))


def _in_ranges(emit: Any, m_node: fx.Node, ranges: list[tuple[int, int | None]]) -> fx.Node:
    """The SymBool "M lies in one of ``ranges``", as graph nodes."""
    pred = None
    for lo, hi in ranges:
        parts = ([emit(operator.ge, m_node, lo)] if lo > 1 else []) + ([emit(operator.le, m_node, hi)] if hi is not None else [])
        term = parts[0] if len(parts) == 1 else emit(operator.and_, *parts)
        pred = term if pred is None else emit(operator.or_, pred, term)
    return pred


def branch(emit: Any, op: fx.Node, table: BucketTable, m: Any) -> fx.Node:
    """Replace the bucketed op node ``op`` (inserted by ``emit``, a GraphEmitter) by the branch;
    ``m`` is the site's row count M (a SymInt). Returns the node the op's users now read: the
    cond's outputs (all-gather: a tuple like the op's list) or its single output (GEMM ->
    collective). The op node is erased."""
    graph = emit.graph
    owner = graph.owning_module
    if owner is None:
        return op
    ranges = as_written_ranges(table)
    tensors = [a for a in _flat_operands(op) if isinstance(a, fx.Node)]
    # the symbols in the operands' sizes, passed in too: a subgraph binds its sizes' symbols
    # from its own inputs, and M = W x s rows cannot bind s
    symbols = _symbol_sources(graph, [a.meta["val"] for a in tensors])
    if symbols is None:
        return op
    operands = tensors + [ss.size_arg(emit.before, s, emit) for s in symbols]
    fakes = [a.meta["val"] for a in tensors] + symbols
    true_gm = _subgraph(emit, fakes, lambda g, ph: _as_written(g, ph, op, table))
    false_gm = _subgraph(emit, fakes, lambda g, ph: _bucketed(g, ph, op))
    names = [_free_name(owner, "overlap_as_written"), _free_name(owner, "overlap_bucketed")]
    owner.register_module(names[0], true_gm)
    owner.register_module(names[1], false_gm)
    m_node = ss.size_arg(emit.before, m, emit)
    pred = _in_ranges(emit, m_node, ranges)
    with graph.inserting_before(emit.before):
        attrs = [graph.get_attr(n) for n in names]
        cond = graph.call_function(torch.ops.higher_order.cond, (pred, attrs[0], attrs[1], tuple(operands)))
    single = op.target is not torch.ops.overlap_compile.bucketed_allgather_gemm.default
    cond.meta["val"] = (op.meta["val"],) if single else tuple(op.meta["val"])
    cond.meta["overlap_compile"] = True
    emit.new_nodes += [*attrs, cond]
    out = emit(operator.getitem, cond, 0) if single else cond
    op.replace_all_uses_with(out)
    graph.erase_node(op)
    return out


def set_plan_text(node: fx.Node, text: str) -> None:
    """Set the plan text (the last argument) of the op ``node`` calls: ``node`` itself, or for a
    branch the op's call in its bucketed subgraph, whose code is then regenerated."""
    if node.target is not torch.ops.higher_order.cond:
        node.args = (*node.args[:-1], text)
        return
    sub = getattr(node.graph.owning_module, node.args[2].target)
    call = next(n for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    call.args = (*call.args[:-1], text)
    sub.recompile()


def _flat_operands(op: fx.Node) -> list:
    """The op's tensor arguments in its schema's order (the lists flattened, None biases left out)."""
    flat = []
    for a in op.args:
        flat += [x for x in a if x is not None] if isinstance(a, (list, tuple)) else [a]
    return flat


def _symbol_sources(graph: fx.Graph, fakes: list) -> list | None:
    """One SymInt per free symbol of the fakes' sizes, each a size of a graph input that is that
    symbol alone (size_arg builds it from there); None where some symbol is no input's size."""
    wanted = set()
    for f in fakes:
        for d in f.shape:
            if isinstance(d, torch.SymInt):
                wanted |= d.node.expr.free_symbols
    found = {}
    for n in graph.nodes:
        if n.op != "placeholder" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        for d in n.meta["val"].shape:
            if isinstance(d, torch.SymInt) and d.node.expr in wanted:
                found.setdefault(d.node.expr, d)
    if set(found) != wanted:
        return None
    return [found[s] for s in sorted(wanted, key=str)]


def _free_name(owner: torch.nn.Module, stem: str) -> str:
    i = 0
    while hasattr(owner, f"{stem}_{i}"):
        i += 1
    return f"{stem}_{i}"


def _subgraph(emit: Any, fakes: list, body) -> fx.GraphModule:
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    g = fx.Graph()
    placeholders = [g.placeholder(f"arg{i}") for i in range(len(fakes))]
    g.output(tuple(body(g, placeholders)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    FakeTensorProp(gm, emit._fake_mode).propagate_dont_convert_inputs(*fakes)
    return gm


def _operands_by_role(op: fx.Node, ph: list) -> tuple:
    """The placeholders in the op's argument structure: (first, rhs list, bias list)."""
    it = iter(ph)
    if op.target is torch.ops.overlap_compile.bucketed_allgather_gemm.default:
        shard, bs, biases = op.args[0], op.args[1], op.args[2]
        return next(it), [next(it) for _ in bs], [None if b is None else next(it) for b in biases]
    a, b, bias = op.args[0], op.args[1], op.args[2]
    return next(it), [next(it)], [None if bias is None else next(it)]


def _gemm(g: fx.Graph, x: fx.Node, b: fx.Node, bias: fx.Node | None) -> fx.Node:
    if bias is None:
        return g.call_function(aten.mm.default, (x, b))
    return g.call_function(aten.addmm.default, (bias, x, b))


def _as_written(g: fx.Graph, ph: list, op: fx.Node, table: BucketTable) -> list[fx.Node]:
    """templates/bucketed.py's as-written path, as graph nodes (row stripes on the leading dim)."""
    first, bs, biases = _operands_by_role(op, ph)
    group = op.args[3]
    if table.kind == "allgather_gemm":
        gathered = g.call_function(c10d.wait_tensor.default, (
            g.call_function(c10d.all_gather_into_tensor.default, (first, table.world, group)),))
        return [gathered, *[_gemm(g, gathered, b, bias) for b, bias in zip(bs, biases)]]
    y = _gemm(g, first, bs[0], biases[0])
    if table.kind == "gemm_allreduce":
        out = g.call_function(c10d.all_reduce.default, (y, table.reduce_op, group))
    else:
        out = g.call_function(c10d.reduce_scatter_tensor.default, (y, table.reduce_op, table.world, group))
    return [g.call_function(c10d.wait_tensor.default, (out,))]


def _bucketed(g: fx.Graph, ph: list, op: fx.Node) -> list[fx.Node]:
    first, bs, biases = _operands_by_role(op, ph)
    if op.target is torch.ops.overlap_compile.bucketed_allgather_gemm.default:
        out = g.call_function(op.target, (first, bs, biases, *op.args[3:]))
        return [g.call_function(operator.getitem, (out, i)) for i in range(1 + len(bs))]
    return [g.call_function(op.target, (first, bs[0], biases[0], *op.args[3:]))]
