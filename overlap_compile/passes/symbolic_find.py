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
    COLLECTIVES,
    c10d,
    gemm_terms,
    group_name_of,
    is_call,
    mm_operands,
    sole_wait,
    val,
    world_size_of,
)
from .matches import (
    AllGatherGemmMatch,
    GemmAllReduceMatch,
    GemmAllToAllMatch,
    GemmReduceScatterMatch,
    Match,
)
from .site_forms import (
    SYMBOLIC,
    dtype_world_reasons,
    equal_splits,
    escaping_use,
    gathered_rows,
    mixed_dtypes,
    prod,
    shape_of,
    summed_terms,
    undo_scatter_split,
)

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
    # M's expression itself (sympy, over the shape environment's symbols): what a caller binds to
    # a call's sizes (row_dispatch.py); ``expr`` is its text, for signatures and Reports
    sym: Any = dataclasses.field(default=None, compare=False, repr=False)

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
        undone = undo_scatter_split(src, world, SYMBOLIC)
        if undone is not None:
            src, scatter_dim, split_nodes = undone
    summed = gemm_terms(src)
    if summed is None:
        return None
    mms, views = summed
    mm = mms[0]
    a, b, bias, problem = mm_operands(mm)
    reasons = [problem] if problem else []
    (m_size, n), k, view_shape = shape_of(mm), shape_of(a)[1], shape_of(src)
    extra_terms, summed_problems = summed_terms(mms, bias, SYMBOLIC)
    reasons += summed_problems
    for _, a2, _ in extra_terms:
        k2 = shape_of(a2)[1]
        k = k + k2 if isinstance(k, int) and isinstance(k2, int) else None
    chain = [*split_nodes, *views]
    reasons += escaping_use([*mms, *views], chain, coll)
    reasons += _static_nk(n, k)
    dtype = val(mm).dtype
    reasons += dtype_world_reasons(dtype, world, group)
    outer = chunk = None
    if not reasons:
        if view_shape[-1] != n:
            reasons.append(f"the collective's view {list(view_shape)} splits the GEMM's N={n} columns")
        elif cls is not GemmAllReduceMatch:
            outer, chunk, why = _stripes(view_shape, scatter_dim, world,
                                         f"scatter along the GEMM's N dimension (dim {scatter_dim}) is not supported")
            if why:
                reasons.append(why)
            if cls is GemmAllToAllMatch and not reasons and not equal_splits(coll, m_size, world):
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
                        outer=outer, chunk=chunk, view=view, sym=e)


def _stripes(shape: tuple, dim: int, world: int, on_last_dim: str) -> tuple[int | None, int | None, str | None]:
    """(outer, chunk, problem) of a collective along ``dim`` of ``shape``: the symbolic one is
    None; both symbolic is a problem, and so is ``dim`` being the last (the GEMM's N or K:
    ``on_last_dim`` says which)."""
    if dim >= len(shape) - 1:
        return None, None, on_last_dim
    d = shape[dim]
    if isinstance(d, int) and d % world:
        return None, None, f"dim {dim} of shape {list(shape)} is not divisible by world size {world}"
    outer = prod(shape[:dim])
    chunk = (d // world) * prod(shape[dim + 1:-1])
    if isinstance(outer, int):
        return outer, (chunk if isinstance(chunk, int) else None), None
    if isinstance(chunk, int):
        return None, chunk, None
    return None, None, f"symbolic sizes on both sides of the collective's dim {dim} of {list(shape)}"


def _view_args(wait: fx.Node, before: fx.Node, reasons: list[str]) -> tuple:
    """The wait's shape (ints and SymInts), checked to be buildable as view arguments from the
    nodes before ``before`` (symbolic_sizes.size_arg); ``reasons`` gets a problem otherwise."""
    shape = shape_of(wait) or ()
    for s in shape:
        if ss.size_arg(before, s) is None:
            reasons.append(f"no node of the graph gives the symbolic size {ss.expr(s)} of {wait.name}")
            return ()
    return shape


# ---- all-gather -> GEMM ----------------------------------------------------------------------

def _allgather_gemm(ag: fx.Node, graph_name: str) -> Match | None:
    site = gathered_rows(ag, SYMBOLIC)
    if site is None:
        return None
    wait, world, group, gathered, gather_dim, chain, matrix, twins, consumers = site
    gshape = shape_of(gathered)
    reasons = []
    dtype = val(ag).dtype
    k = gshape[-1]
    reasons += _static_nk(0 if all(isinstance(c.n, int) for c in consumers) else None, k)
    reasons += dtype_world_reasons(dtype, world, group)
    reasons += mixed_dtypes(consumers)
    outer = chunk = None
    if not reasons:
        outer, chunk, why = _stripes(gshape, gather_dim, world,
                                     f"gather along the GEMM's K dimension (dim {gather_dim}) is not supported")
        if why:
            reasons.append(why)
    m_size = prod(gshape[:-1])
    view: tuple = ()
    if not reasons:
        view = gshape
        local_rows = prod(shape_of(ag.args[0])[:-1])
        if any(ss.size_arg(ag, s) is None for s in (*gshape, local_rows)):
            reasons.append(f"no node of the graph gives the symbolic sizes of {gathered.name} {list(gshape)}")
    rows = _rows(m_size, outer, chunk, view)
    stripes = rows.stripes_at(rows.hint, world) if not reasons else RowStripes(1, max(world, 1), 1)
    return SymbolicAllGather(
        group_name=group, world_size=world, dtype=dtype, graph=graph_name, unsupported="; ".join(reasons) or None,
        ag_node=ag, wait_node=wait, shard_node=ag.args[0], chain_nodes=chain, full_node=gathered,
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
