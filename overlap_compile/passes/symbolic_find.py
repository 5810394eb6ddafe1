"""find for sites whose row count is symbolic (torch.compile's dynamic shapes).

A graph compiled with a dynamic sequence length carries sizes such as ``4*s88``. Such a site is
found here, in the same forms ``find`` knows (views, DTensor's split/cat and slice forms, sums of
GEMMs, equal all-to-all splits), when only its row count M (the GEMM's M, the gathered or
scattered dimension) is symbolic; N and K must be ints. The match is the kind's usual class plus
``rows`` (``SymbolicRows``): M's expression, its size hint and the compile's bounds, the row
stripes with the one symbolic factor left open, and the view arguments (ints, or nodes giving a
symbolic size) that rebuild the collective's result shape. ``m``, ``stripes`` and ``view_shape``
hold the size hint's values, so the predictor prices the match as it is at the hint. Sizes are
read without guards (symbolic_sizes.py): a guard would pin the length the compile was made for.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch.fx as fx

from ..tiling import RowStripes
from . import symbolic_sizes as ss
from .graph_utils import (
    MM_OPS,
    SUPPORTED_DTYPES,
    VIEW_OPS,
    aten,
    c10d,
    gemm_terms,
    getitems_of,
    group_name_of,
    is_call,
    mm_operands,
    single_user,
    sole_wait,
    val,
    world_size_of,
)
from .matches import (
    AllGatherGemmMatch,
    GemmAllReduceMatch,
    GemmAllToAllMatch,
    GemmConsumer,
    GemmReduceScatterMatch,
    Match,
)

COLLECTIVES = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default,
               c10d.all_gather_into_tensor.default)


@dataclasses.dataclass(frozen=True)
class SymbolicRows:
    """The symbolic row count of a site. ``outer``/``chunk``: the row stripes (tiling.RowStripes)
    with the symbolic one None (M = outer * W * chunk); both None for an all-reduce. ``unit``: M
    is a multiple of it (the static factor of M's expression). ``view``: the collective's result
    shape (all-gather: the gathered tensor's) as view arguments."""

    expr: str
    hint: int
    lo: int
    hi: int | None
    unit: int
    outer: int | None
    chunk: int | None
    view: tuple = ()

    def stripes_at(self, m: int, world: int) -> RowStripes | None:
        if self.outer is None and self.chunk is None:
            return None
        if self.outer is not None:
            return RowStripes(self.outer, world, max(1, m // (self.outer * world)))
        return RowStripes(max(1, m // (self.chunk * world)), world, self.chunk)


def _sym_fields(cls: type) -> type:
    """``cls`` with the ``rows`` field (None on the static copies the decision prices)."""
    def signature_extra(self) -> str:
        base = cls.signature_extra(self)
        return base if self.rows is None else f"{base}|rows={self.rows.expr}"

    return dataclasses.make_dataclass(f"Symbolic{cls.__name__}", [("rows", Any, dataclasses.field(default=None))],
                                      bases=(cls,), namespace={"signature_extra": signature_extra})


SymbolicAllReduce = _sym_fields(GemmAllReduceMatch)
SymbolicReduceScatter = _sym_fields(GemmReduceScatterMatch)
SymbolicAllToAll = _sym_fields(GemmAllToAllMatch)
SymbolicAllGather = _sym_fields(AllGatherGemmMatch)
_SYMBOLIC = {GemmAllReduceMatch: SymbolicAllReduce, GemmReduceScatterMatch: SymbolicReduceScatter,
             GemmAllToAllMatch: SymbolicAllToAll}


def is_symbolic_site(match: Any) -> bool:
    return getattr(match, "rows", None) is not None


def symbolic_collective(node: fx.Node) -> bool:
    """A collective whose input or output has a symbolic size."""
    if not is_call(node, COLLECTIVES):
        return False
    ins = node.args[0] if isinstance(node.args[0], fx.Node) else None
    return any(_has_sym(val(n)) for n in (node, ins) if n is not None)


def _has_sym(v: Any) -> bool:
    return hasattr(v, "shape") and any(ss.is_sym(s) for s in v.shape)


def _shape(node: Any) -> tuple | None:
    v = val(node) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def _size_of(arg: Any) -> Any:
    """An int argument, or the SymInt a node argument holds."""
    return val(arg) if isinstance(arg, fx.Node) else arg


def _prod(xs) -> Any:
    out = 1
    for x in xs:
        out = out * x
    return out


def find_symbolic(coll: fx.Node, graph_name: str) -> Match | None:
    """The site at a symbolic collective, or None where it is not a GEMM site (find goes on)."""
    if is_call(coll, c10d.all_gather_into_tensor.default):
        return _allgather_gemm(coll, graph_name)
    cls = {c10d.all_reduce.default: GemmAllReduceMatch, c10d.reduce_scatter_tensor.default: GemmReduceScatterMatch,
           c10d.all_to_all_single.default: GemmAllToAllMatch}[coll.target]
    return _gemm_then_collective(coll, cls, graph_name)


def _gemm_then_collective(coll: fx.Node, cls: type, graph_name: str) -> Match | None:
    wait = sole_wait(coll)
    if wait is None:
        return None
    group = group_name_of(coll.args[-1])
    world = coll.args[2] if cls is GemmReduceScatterMatch else world_size_of(group)
    reduce_op = coll.args[1] if cls is not GemmAllToAllMatch else None
    src, scatter_dim, split_nodes = coll.args[0], 0, []
    if cls is GemmReduceScatterMatch and world:
        undone = _undo_scatter_split(src, world)
        if undone is not None:
            src, scatter_dim, split_nodes = undone
    summed = gemm_terms(src)
    if summed is None:
        return None
    mms, views = summed
    mm = mms[0]
    a, b, bias, problem = mm_operands(mm)
    reasons = [problem] if problem else []
    mshape, ashape, view_shape = _shape(mm), _shape(a), _shape(src)
    m_size, n = mshape
    k = ashape[1]
    extra_terms = []
    for other in mms[1:]:
        a2, b2, bias2, _ = mm_operands(other)
        oshape = _shape(other)
        if bias is not None or bias2 is not None:
            reasons.append("a sum of GEMMs with bias is not supported")
        elif not (ss.same(oshape[0], m_size) and oshape[1] == n) or val(other).dtype != val(mm).dtype:
            reasons.append("the summed GEMMs differ in shape or dtype")
        extra_terms.append((other, a2, b2))
        k2 = _shape(a2)[1]
        k = k + k2 if isinstance(k, int) and isinstance(k2, int) else None
    chain = [*split_nodes, *views]
    for node in [*mms, *views]:
        others = [u.name for u in node.users if u not in chain and u is not coll]
        if others:
            reasons.append(f"GEMM output {node.name} is also used by {others}")
            break
    reasons += _static_nk(n, k)
    dtype = val(mm).dtype
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} not supported (float32, bfloat16, float16 are)")
    if world is None:
        reasons.append(f"process group {group!r} is not known in this process")
    elif world < 2:
        reasons.append("world size 1: nothing to overlap")
    outer = chunk = None
    if not reasons:
        if view_shape[-1] != n:
            reasons.append(f"the collective's view {list(view_shape)} splits the GEMM's N={n} columns")
        elif cls is not GemmAllReduceMatch:
            if scatter_dim >= len(view_shape) - 1:
                reasons.append(f"scatter along the GEMM's N dimension (dim {scatter_dim}) is not supported")
            else:
                outer, chunk, why = _stripes(view_shape, scatter_dim, world)
                if why:
                    reasons.append(why)
            if cls is GemmAllToAllMatch and not reasons and not _equal_splits(coll, m_size, world):
                reasons.append("all_to_all_single with unequal split sizes is not supported")
    view = _view_args(wait, coll, reasons)
    rows = _rows(m_size, outer, chunk, view)
    hint_view = tuple(ss.hint(s) for s in view_shape)
    kw = dict(group_name=group, world_size=world or 0, dtype=dtype, graph=graph_name,
              unsupported="; ".join(reasons) or None, mm_node=mm, a_node=a, b_node=b, bias_node=bias,
              collective_node=coll, wait_node=wait, chain_nodes=chain, m=rows.hint, n=n if isinstance(n, int) else 0,
              k=k or 0, view_shape=hint_view, stripes=rows.stripes_at(rows.hint, world or 1) if not reasons else None,
              reduce_op=reduce_op, extra_terms=extra_terms, output_fuses=False, rows=rows)
    if cls is GemmReduceScatterMatch:
        kw["scatter_dim"] = scatter_dim
    return _SYMBOLIC[cls](**kw)


def _static_nk(n: Any, k: Any) -> list[str]:
    if not isinstance(n, int) or not isinstance(k, int):
        return ["symbolic shapes beyond the row count: the GEMM's N or K is symbolic here (only M may be)"]
    return []


def _rows(m_size: Any, outer: Any, chunk: Any, view: tuple) -> SymbolicRows:
    e = ss.expr(m_size)
    coeff = e.as_coeff_Mul()[0] if hasattr(e, "as_coeff_Mul") else 1
    lo, hi = ss.value_range(m_size)
    unit = int(coeff) if getattr(coeff, "is_Integer", False) and int(coeff) > 0 else 1
    return SymbolicRows(expr=str(e), hint=ss.hint(m_size, 1), lo=max(lo, 1), hi=hi, unit=unit,
                        outer=outer, chunk=chunk, view=view)


def _stripes(shape: tuple, dim: int, world: int) -> tuple[int | None, int | None, str | None]:
    """(outer, chunk, problem) of a collective along ``dim`` of ``shape``: the symbolic one is
    None; both symbolic is a problem."""
    d = shape[dim]
    if isinstance(d, int) and d % world:
        return None, None, f"dim {dim} of shape {list(shape)} is not divisible by world size {world}"
    outer = _prod(shape[:dim])
    chunk = (d // world) * _prod(shape[dim + 1:-1])
    if isinstance(outer, int):
        return outer, (chunk if isinstance(chunk, int) else None), None
    if isinstance(chunk, int):
        return None, chunk, None
    return None, None, f"symbolic sizes on both sides of the collective's dim {dim} of {list(shape)}"


def _equal_splits(a2a: fx.Node, m_size: Any, world: int) -> bool:
    want = m_size // world
    outs, ins = a2a.args[1], a2a.args[2]
    if outs is None or ins is None or len(outs) != world or len(ins) != world:
        return False
    return all(ss.same(_size_of(s), want) for s in [*outs, *ins])


def _view_args(wait: fx.Node, before: fx.Node, reasons: list[str]) -> tuple:
    """The wait's shape (ints and SymInts), checked to be buildable as view arguments from the
    nodes before ``before`` (symbolic_sizes.size_arg); ``reasons`` gets a problem otherwise."""
    shape = _shape(wait) or ()
    for s in shape:
        if ss.size_arg(before, s) is None:
            reasons.append(f"no node of the graph gives the symbolic size {ss.expr(s)} of {wait.name}")
            return ()
    return shape


def _undo_scatter_split(coll_input: fx.Node, world: int) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``cat([split(x, S/W, d)[0..W-1]], 0)`` or the slice form -> (x, d, nodes); sizes compared by
    expression."""
    if not is_call(coll_input, aten.cat.default):
        return None
    parts = coll_input.args[0]
    cat_dim = coll_input.args[1] if len(coll_input.args) > 1 else coll_input.kwargs.get("dim", 0)
    if cat_dim != 0 or len(parts) != world:
        return None
    sliced = _equal_slices(parts, world)
    if sliced is not None:
        return sliced[0], sliced[1], [coll_input, *parts]
    split = parts[0].args[0] if parts[0].op == "call_function" and parts[0].args else None
    if not is_call(split, aten.split.Tensor):
        return None
    items = getitems_of(split)
    if items is None or list(parts) != items:
        return None
    src = split.args[0]
    shape = _shape(src)
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
    if not ss.same(_size_of(split.args[1]) * world, shape[dim]):
        return None
    return src, dim, [coll_input, *items, split]


def _equal_slices(parts: list, world: int) -> tuple[fx.Node, int] | None:
    """W slices ``[i*c, (i+1)*c)`` of one tensor along one dim, each used once (sizes by expression)."""
    if not all(is_call(p, aten.slice.Tensor) and len(p.users) == 1 for p in parts):
        return None
    src = parts[0].args[0]
    shape = _shape(src)
    if shape is None or any(p.args[0] is not src for p in parts):
        return None
    dims = {(p.args[1] if len(p.args) > 1 else 0) % len(shape) for p in parts}
    if len(dims) != 1:
        return None
    (dim,) = dims
    c = shape[dim] // world
    for i, p in enumerate(parts):
        start, end = (list(p.args[2:4]) + [None, None])[:2]
        step = p.args[4] if len(p.args) > 4 else 1
        if step != 1 or not ss.same(_size_of(start), i * c):
            return None
        if not (i == world - 1 and end in (None, 2 ** 63 - 1)) and not ss.same(_size_of(end), (i + 1) * c):
            return None
    if not ss.same(c * world, shape[dim]):
        return None
    return src, dim


# ---- all-gather -> GEMM ----------------------------------------------------------------------

def _redo_gather_cat(wait: fx.Node, world: int) -> tuple[fx.Node, int, list[fx.Node]]:
    """``cat(split(wait, B, 0)[0..W-1], d)`` (or W slices) -> (cat, d, nodes); else (wait, 0, [])."""
    users = list(wait.users)
    if len(users) == world and all(is_call(u, aten.slice.Tensor) for u in users):
        cat = single_user(users[0])
        if is_call(cat, aten.cat.default) and set(cat.args[0]) == set(users):
            sliced = _equal_slices(list(cat.args[0]), world)
            if sliced is not None and sliced[1] == 0:
                d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
                return cat, d % len(_shape(cat)), [*cat.args[0], cat]
    split = single_user(wait)
    if not is_call(split, aten.split.Tensor):
        return wait, 0, []
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    items = getitems_of(split)
    if dim != 0 or items is None or len(items) != world or any(len(i.users) != 1 for i in items):
        return wait, 0, []
    cat = single_user(items[0])
    if not is_call(cat, aten.cat.default) or list(cat.args[0]) != items:
        return wait, 0, []
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return cat, d % len(_shape(cat)), [split, *items, cat]


def _flatten_rows(gathered: fx.Node) -> tuple[fx.Node | None, list[fx.Node], list[fx.Node]]:
    """As find._flatten_rows, with shapes compared by expression: (the [M, K] node, the views on
    the way, its twins)."""
    shape = _shape(gathered)
    node, chain = gathered, []
    while len(shape) > 2:
        views = [u for u in node.users if is_call(u, VIEW_OPS) and _shape(u) and _shape(u)[-1] == shape[-1]]
        if chain and len(node.users) != len(views):
            return None, [], []
        if len(views) > 1 and all(len(_shape(v)) == 2 for v in views) \
                and all(ss.same(_shape(v)[0], _shape(views[0])[0]) for v in views):
            chain.extend(views)
            return views[0], chain, views[1:]
        if len(views) != 1:
            return None, [], []
        node = views[0]
        chain.append(node)
        shape = _shape(node)
    return node, chain, []


def _allgather_gemm(ag: fx.Node, graph_name: str) -> Match | None:
    wait = sole_wait(ag)
    if wait is None:
        return None
    world = ag.args[1]
    group = group_name_of(ag.args[2])
    gathered, gather_dim, chain = _redo_gather_cat(wait, world)
    gshape = _shape(gathered)
    matrix, flat_chain, twins = _flatten_rows(gathered)
    if matrix is None:
        return None
    consumers = []
    for view in (matrix, *twins):
        for u in view.users:
            if is_call(u, MM_OPS) and mm_operands(u)[0] is view and mm_operands(u)[3] is None:
                _, b, bias, _ = mm_operands(u)
                consumers.append(GemmConsumer(mm_node=u, b_node=b, bias_node=bias, n=_shape(u)[1]))
    if not consumers:
        return None
    reasons = []
    dtype = val(ag).dtype
    k = gshape[-1]
    reasons += _static_nk(0 if all(isinstance(c.n, int) for c in consumers) else None, k)
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} not supported (float32, bfloat16, float16 are)")
    if world < 2:
        reasons.append("world size 1: nothing to overlap")
    if len({val(c.mm_node).dtype for c in consumers}) > 1:
        reasons.append("GEMMs of mixed dtypes")
    outer = chunk = None
    if not reasons:
        if gather_dim >= len(gshape) - 1:
            reasons.append(f"gather along the GEMM's K dimension (dim {gather_dim}) is not supported")
        else:
            outer, chunk, why = _stripes(gshape, gather_dim, world)
            if why:
                reasons.append(why)
    m_size = _prod(gshape[:-1])
    view: tuple = ()
    if not reasons:
        view = gshape
        local_rows = _prod(_shape(ag.args[0])[:-1])
        if any(ss.size_arg(ag, s) is None for s in (*gshape, local_rows)):
            reasons.append(f"no node of the graph gives the symbolic sizes of {gathered.name} {list(gshape)}")
    rows = _rows(m_size, outer, chunk, view)
    stripes = rows.stripes_at(rows.hint, world) if not reasons else RowStripes(1, max(world, 1), 1)
    return SymbolicAllGather(
        group_name=group, world_size=world, dtype=dtype, graph=graph_name, unsupported="; ".join(reasons) or None,
        ag_node=ag, wait_node=wait, shard_node=ag.args[0], chain_nodes=chain + flat_chain, full_node=gathered,
        gathered_node=matrix, gathered_twins=twins, gathered_shape=tuple(ss.hint(s) for s in gshape),
        gather_dim=gather_dim, consumers=[dataclasses.replace(c, n=c.n if isinstance(c.n, int) else 0)
                                          for c in consumers],
        m=rows.hint, k=k if isinstance(k, int) else 0, stripes=stripes, rows=rows)


def unit_rows(rows: SymbolicRows, world: int) -> int:
    """The step between valid row counts: M's static factor and, for stripes, outer*W or chunk*W."""
    step = rows.unit
    if rows.outer is not None:
        step = math.lcm(step, rows.outer * world)
    elif rows.chunk is not None:
        step = math.lcm(step, rows.chunk * world)
    return step
