"""The site forms that find (static shapes) and symbolic_find (a symbolic row count) both read.

Each helper takes a ``Reading``: how the finder reads a node's shape (find: ints only, so a
symbolic node reads as None and is passed over; symbolic_find: any sizes) and which split ops it
takes as DTensor's split form. Sizes are compared with symbolic_sizes.same, which is plain ``==``
on ints and a comparison of expressions (no guard) otherwise, so one helper serves both finders.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch.fx as fx

from . import symbolic_sizes as ss
from .graph_utils import (
    MM_OPS,
    SUPPORTED_DTYPES,
    VIEW_OPS,
    aten,
    getitems_of,
    group_name_of,
    is_call,
    mm_operands,
    single_user,
    sole_wait,
    static_shape,
    val,
)
from .matches import GemmConsumer


def shape_of(node: Any) -> tuple | None:
    """A node's shape with its symbolic sizes as SymInts; None when it holds no tensor."""
    v = val(node) if isinstance(node, fx.Node) else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def size_of(arg: Any) -> Any:
    """An int argument, or the SymInt a node argument holds."""
    return val(arg) if isinstance(arg, fx.Node) else arg


@dataclasses.dataclass(frozen=True)
class Reading:
    """``shape``: a node's shape, or None where the finder does not read it. ``splits``: the split
    ops taken as the split form."""

    shape: Callable[[Any], tuple | None]
    splits: tuple


STATIC = Reading(static_shape, (aten.split.Tensor, aten.split_with_sizes.default))
SYMBOLIC = Reading(shape_of, (aten.split.Tensor,))


def prod(xs) -> Any:
    out = 1
    for x in xs:
        out = out * x
    return out


def equal_slices(parts: list, world: int, read: Reading) -> tuple[fx.Node, int] | None:
    """``[slice(x, d, i*c, (i+1)*c) for i in range(W)]`` (each used once) -> (x, d); else None.
    ``reduce_scatter_tensor_autograd`` / ``all_gather_tensor_autograd`` emit this instead of split."""
    if not all(is_call(p, aten.slice.Tensor) and len(p.users) == 1 for p in parts):
        return None
    src = parts[0].args[0]
    shape = read.shape(src)
    if shape is None or any(p.args[0] is not src for p in parts):
        return None
    dims = {(p.args[1] if len(p.args) > 1 else 0) % len(shape) for p in parts}
    if len(dims) != 1:
        return None
    (dim,) = dims
    c = shape[dim] // world
    if not ss.same(c * world, shape[dim]):
        return None
    for i, p in enumerate(parts):
        start, end = (list(p.args[2:4]) + [None, None])[:2]
        step = p.args[4] if len(p.args) > 4 else 1
        if step != 1 or start is None or not ss.same(size_of(start), i * c):
            return None
        open_end = i == world - 1 and end in (None, 2 ** 63 - 1)  # the last slice may run to the end
        if not open_end and (end is None or not ss.same(size_of(end), (i + 1) * c)):
            return None
    return src, dim


def undo_scatter_split(coll_input: fx.Node, world: int, read: Reading) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``cat([split(x, S/W, d)[0..W-1]], 0)`` or the slice form -> (x, d, [cat, parts, split]);
    None if not that form."""
    if not is_call(coll_input, aten.cat.default):
        return None
    parts = coll_input.args[0]
    cat_dim = coll_input.args[1] if len(coll_input.args) > 1 else coll_input.kwargs.get("dim", 0)
    if cat_dim != 0 or len(parts) != world:
        return None
    sliced = equal_slices(parts, world, read)
    if sliced is not None:
        return sliced[0], sliced[1], [coll_input, *parts]
    split = parts[0].args[0] if parts[0].op == "call_function" and parts[0].args else None
    if not is_call(split, read.splits):
        return None
    items = getitems_of(split)
    if items is None or list(parts) != items:
        return None
    src = split.args[0]
    shape = read.shape(src)
    if shape is None:
        return None
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
    sizes = [split.args[1]] if split.target == aten.split.Tensor else list(split.args[1])
    if not all(ss.same(size_of(s) * world, shape[dim]) for s in sizes):
        return None
    return src, dim, [coll_input, *items, split]


def redo_gather_cat(wait: fx.Node, world: int, read: Reading) -> tuple[fx.Node, int, list[fx.Node]]:
    """``cat(split(wait, B, 0)[0..W-1], d)`` or W slices -> (cat, d, nodes); else (wait, 0, [])."""
    users = list(wait.users)
    if len(users) == world and all(is_call(u, aten.slice.Tensor) for u in users):
        cat = single_user(users[0])
        if is_call(cat, aten.cat.default) and len(cat.args[0]) == world and set(cat.args[0]) == set(users):
            sliced = equal_slices(list(cat.args[0]), world, read)
            if sliced is not None and sliced[1] == 0:
                return cat, _cat_dim(cat, read), [*cat.args[0], cat]
    split = single_user(wait)
    if not is_call(split, read.splits):
        return wait, 0, []
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    items = getitems_of(split)
    if dim != 0 or items is None or len(items) != world or any(len(i.users) != 1 for i in items):
        return wait, 0, []
    cat = single_user(items[0])
    if not is_call(cat, aten.cat.default) or list(cat.args[0]) != items:
        return wait, 0, []
    return cat, _cat_dim(cat, read), [split, *items, cat]


def _cat_dim(cat: fx.Node, read: Reading) -> int:
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    shape = read.shape(cat)
    return d % len(shape) if shape else d


def flatten_rows(gathered: fx.Node, read: Reading) -> tuple[fx.Node | None, list[fx.Node], list[fx.Node]]:
    """Follow views that keep the last dim from ``gathered`` down to a 2-D node: (the 2-D node,
    the views on the way, its twins). Twins are further views to the same 2-D shape from the
    same node: an inference graph flattens ``[1, S, K]`` once per GEMM (the Q, K and V
    projections each read their own ``reshape(x, [S, K])``), a training graph once for all."""
    shape = read.shape(gathered)
    if shape is None:
        return None, [], []
    node, chain = gathered, []
    while len(shape) > 2:
        views = [u for u in node.users if is_call(u, VIEW_OPS) and read.shape(u) and ss.same(read.shape(u)[-1], shape[-1])]
        if chain and len(node.users) != len(views):
            return None, [], []  # an intermediate view read elsewhere: not a plain flattening
        first = read.shape(views[0]) if views else None
        if len(views) > 1 and len(first) == 2 and all(ss.same_shape(read.shape(v), first) for v in views):
            chain.extend(views)
            return views[0], chain, views[1:]
        if len(views) != 1:
            return None, [], []
        node = views[0]
        chain.append(node)
        shape = read.shape(node)
    return node, chain, []


def gemm_consumers(matrix: fx.Node, twins: list[fx.Node], read: Reading) -> list[GemmConsumer]:
    """The mm nodes (no addmm problem) reading ``matrix`` or one of its twins as their A operand."""
    consumers = []
    for view in (matrix, *twins):
        for u in view.users:
            if is_call(u, MM_OPS) and mm_operands(u)[0] is view and mm_operands(u)[3] is None:
                _, b, bias, _ = mm_operands(u)
                shape = read.shape(u)
                consumers.append(GemmConsumer(mm_node=u, b_node=b, bias_node=bias, n=shape[1] if shape else 0))
    return consumers


def summed_terms(mms: list[fx.Node], bias: Any, read: Reading) -> tuple[list[tuple], list[str]]:
    """(the terms after the first of a sum of GEMMs as (mm, a, b), the reasons they are refused)."""
    mm, extra_terms, reasons = mms[0], [], []
    for other in mms[1:]:
        a2, b2, bias2, _ = mm_operands(other)
        if bias is not None or bias2 is not None:
            reasons.append("a sum of GEMMs with bias is not supported")
        elif not ss.same_shape(read.shape(other), read.shape(mm)) or val(other).dtype != val(mm).dtype:
            reasons.append("the summed GEMMs differ in shape or dtype")
        extra_terms.append((other, a2, b2))
    return extra_terms, reasons


def escaping_use(nodes: list[fx.Node], chain: list[fx.Node], coll: fx.Node) -> list[str]:
    """Every node from the mm(s) to the collective must feed only the next one: otherwise the
    plain GEMM output is needed elsewhere and rewriting would compute it twice."""
    for n in nodes:
        others = [u.name for u in n.users if u not in chain and u is not coll]
        if others:
            return [f"GEMM output {n.name} is also used by {others}"]
    return []


def dtype_world_reasons(dtype: Any, world: int | None, group: str) -> list[str]:
    """The site's dtype (None: unknown, not refused) and its group's size."""
    reasons = []
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} not supported (float32, bfloat16, float16 are)")
    if world is None:
        reasons.append(f"process group {group!r} is not known in this process")
    elif world < 2:
        reasons.append("world size 1: nothing to overlap")
    return reasons


def mixed_dtypes(consumers: list[GemmConsumer]) -> list[str]:
    dtypes = {val(c.mm_node).dtype for c in consumers if val(c.mm_node) is not None}
    return [f"GEMMs of mixed dtypes {sorted(map(str, dtypes))}"] if len(dtypes) > 1 else []


def equal_splits(a2a: fx.Node, rows: Any, world: int) -> bool:
    """Whether an all_to_all_single sends and receives ``rows / W`` rows to and from each rank."""
    outs, ins = a2a.args[1], a2a.args[2]
    if outs is None or ins is None or len(outs) != world or len(ins) != world:
        return False
    if isinstance(rows, int) and rows % world:
        return False
    want = rows // world
    return all(ss.same(size_of(s), want) for s in [*outs, *ins])


class GatheredRows(NamedTuple):
    """An all-gather read up to the GEMMs on its rows: ``gathered`` the full tensor (after the
    split/cat that undoes a gather along another dim), ``matrix`` its [M, K] view and ``twins``
    that view's twins (flatten_rows), ``chain`` the nodes between the wait and ``matrix``."""

    wait: fx.Node
    world: int
    group: str
    gathered: fx.Node
    gather_dim: int
    chain: list
    matrix: fx.Node
    twins: list
    consumers: list


def gathered_rows(ag: fx.Node, read: Reading) -> GatheredRows | None:
    """The all-gather -> GEMM form at ``ag``; None where the all-gather feeds no GEMM rows (not a
    site). The [M, K] matrix is the gathered tensor itself when 2-D, else reached through views
    that keep the last dim (K): such views keep the row-major row order, e.g. with batch 1
    [W*S/W... , K] -> [1, S, K] -> [S, K]."""
    wait = sole_wait(ag)
    if wait is None:
        return None
    world, group = ag.args[1], group_name_of(ag.args[2])
    gathered, gather_dim, chain = redo_gather_cat(wait, world, read)
    matrix, flat_chain, twins = flatten_rows(gathered, read)
    if matrix is None:
        return None
    consumers = gemm_consumers(matrix, twins, read)
    if not consumers:
        return None
    return GatheredRows(wait, world, group, gathered, gather_dim, chain + flat_chain, matrix,
                        twins, consumers)
