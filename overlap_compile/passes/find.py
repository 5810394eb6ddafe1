"""find: post-grad FX graph -> list of Match. Pure: never mutates the graph.

Recognised (functional collectives, ``_c10d_functional.*``):

    gemm_allreduce      mm/addmm -> view* -> all_reduce -> wait_tensor
    gemm_reducescatter  mm/addmm -> view* [-> split(dim d) -> getitem* -> cat(dim 0)] -> reduce_scatter_tensor -> wait
    gemm_alltoall       mm/addmm -> view* -> all_to_all_single (equal splits) -> wait
    allgather_gemm      all_gather_into_tensor -> wait [-> split(dim 0) -> getitem* -> cat(dim d)] -> view* -> mm (A operand)

DTensor's ``Shard(d)`` layouts produce exactly the split/cat forms above (see tests/test_find.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import (
    consumers_fuse,
    MM_OPS,
    SUPPORTED_DTYPES,
    VIEW_OPS,
    aten,
    c10d,
    gemm_terms,
    getitems_of,
    group_name_of,
    is_call,
    is_symbolic,
    mm_operands,
    single_user,
    sole_wait,
    static_shape,
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
from ..tiling import RowStripes


def find(graph: fx.Graph, graph_name: str = "forward") -> list[Match]:
    from .find_moe import moe_section
    from .symbolic_find import find_symbolic, symbolic_collective

    matches: list[Match] = []
    in_moe: set[fx.Node] = set()  # all-to-alls already reported as part of a MoE section
    for node in graph.nodes:
        if node in in_moe:
            continue
        if symbolic_collective(node):  # dynamic shapes: a site with a symbolic row count
            m = find_symbolic(node, graph_name)
            if m is not None:
                matches.append(m)
                continue
        if is_call(node, c10d.all_to_all_single.default):
            # a GEMM -> all-to-all site the templates can take wins; else an expert-parallel
            # section starting here is reported (both of its all-to-alls)
            m = _gemm_then_collective(node, GemmAllToAllMatch, graph_name)
            if m is None or m.unsupported:
                group = group_name_of(node.args[3])
                moe = moe_section(node, group, world_size_of(group) or 0, graph_name)
                if moe is not None:
                    in_moe.add(moe.combine_node)
                    m = moe
            if m is not None:
                matches.append(m)
            continue
        if is_call(node, c10d.all_reduce.default):
            m = _gemm_then_collective(node, GemmAllReduceMatch, graph_name)
        elif is_call(node, c10d.reduce_scatter_tensor.default):
            m = _gemm_then_collective(node, GemmReduceScatterMatch, graph_name)
        elif is_call(node, c10d.all_gather_into_tensor.default):
            m = _allgather_gemm(node, graph_name)
        else:
            continue
        if m is not None:
            matches.append(m)
    return matches


def _undo_scatter_split(coll_input: fx.Node, world: int) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``cat([split(x, s, d)[0..W-1]], 0)`` -> (x, d, [cat, getitems, split]); None if not that form."""
    if not is_call(coll_input, aten.cat.default):
        return None
    parts = coll_input.args[0]
    cat_dim = coll_input.args[1] if len(coll_input.args) > 1 else coll_input.kwargs.get("dim", 0)
    if cat_dim != 0 or len(parts) != world:
        return None
    sliced = _equal_slices(parts, world)  # the autograd functional collectives' form
    if sliced is not None:
        src, dim = sliced
        return src, dim, [coll_input, *parts]
    split = parts[0].args[0] if parts[0].op == "call_function" and parts[0].args else None
    if not is_call(split, (aten.split.Tensor, aten.split_with_sizes.default)):
        return None
    items = getitems_of(split)
    if items is None or list(parts) != items:
        return None
    src = split.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    shape = static_shape(src)
    if shape is None:
        return None
    dim = dim % len(shape)
    if shape[dim] % world:
        return None
    if split.target == aten.split.Tensor:
        if split.args[1] != shape[dim] // world:
            return None
    elif any(s != shape[dim] // world for s in split.args[1]):
        return None
    return src, dim, [coll_input, *items, split]


def _equal_slices(parts: list, world: int) -> tuple[fx.Node, int] | None:
    """``[slice(x, d, i*c, (i+1)*c) for i in range(W)]`` (each used once) -> (x, d); else None.
    ``reduce_scatter_tensor_autograd`` / ``all_gather_tensor_autograd`` emit this instead of split."""
    if not all(is_call(p, aten.slice.Tensor) and len(p.users) == 1 for p in parts):
        return None
    src = parts[0].args[0]
    shape = static_shape(src)
    if shape is None or any(p.args[0] is not src for p in parts):
        return None
    dims = {(p.args[1] if len(p.args) > 1 else 0) % len(shape) for p in parts}
    if len(dims) != 1:
        return None
    (dim,) = dims
    if shape[dim] % world:
        return None
    c = shape[dim] // world
    for i, p in enumerate(parts):
        start, end = (list(p.args[2:4]) + [None, None])[:2]
        step = p.args[4] if len(p.args) > 4 else 1
        if start != i * c or end not in (((i + 1) * c),) + ((None, 2 ** 63 - 1) if i == world - 1 else ()) or step != 1:
            return None
    return src, dim


def _gemm_then_collective(coll: fx.Node, cls: type, graph_name: str) -> Match | None:
    wait = sole_wait(coll)
    if wait is None:
        return None
    group = group_name_of(coll.args[-1])
    if cls is GemmReduceScatterMatch:
        world, reduce_op = coll.args[2], coll.args[1]
    elif cls is GemmAllReduceMatch:
        world, reduce_op = world_size_of(group), coll.args[1]
    else:
        world, reduce_op = world_size_of(group), None

    src = coll.args[0]
    scatter_dim, split_nodes = 0, []
    if cls is GemmReduceScatterMatch:
        undone = _undo_scatter_split(src, world)
        if undone is not None:
            src, scatter_dim, split_nodes = undone
    view_shape = static_shape(src)
    summed = gemm_terms(src)
    if summed is None:
        return None  # a collective not fed by a GEMM is not a site
    mms, views = summed
    mm = mms[0]

    a, b, bias, problem = mm_operands(mm)
    v = val(mm)
    reasons = []
    if problem:
        reasons.append(problem)
    extra_terms = []
    for other in mms[1:]:
        a2, b2, bias2, _ = mm_operands(other)
        if bias is not None or bias2 is not None:
            reasons.append("a sum of GEMMs with bias is not supported")
        elif static_shape(other) != static_shape(mm) or val(other).dtype != v.dtype:
            reasons.append("the summed GEMMs differ in shape or dtype")
        extra_terms.append((other, a2, b2))
    chain = [*split_nodes, *views]
    # Every node from the mm(s) to the collective must feed only the next one: otherwise the
    # plain GEMM output is needed elsewhere and rewriting would compute it twice.
    for n in [*mms, *views]:
        others = [u.name for u in n.users if u not in chain and u is not coll]
        if others:
            reasons.append(f"GEMM output {n.name} is also used by {others}")
            break
    if any(is_symbolic(n) for n in (mm, a, b, coll)) or view_shape is None:
        reasons.append("symbolic shapes are not handled yet (compile with dynamic=False)")
    if v is not None and v.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {v.dtype} not supported (float32, bfloat16, float16 are)")
    if world is None:
        reasons.append(f"process group {group!r} is not known in this process")
    elif world < 2:
        reasons.append("world size 1: nothing to overlap")

    m_, n_, k_ = 0, 0, 0
    a_shapes = [static_shape(x) for x in [a] + [t[1] for t in extra_terms]]
    if static_shape(mm) is not None and all(s is not None for s in a_shapes):
        m_, n_ = static_shape(mm)
        k_ = sum(s[1] for s in a_shapes)
    stripes = None
    if not reasons:
        if view_shape[-1] != n_:
            reasons.append(f"the collective's view {list(view_shape)} splits the GEMM's N={n_} columns")
        elif cls is not GemmAllReduceMatch:
            if len(view_shape) < 2:
                reasons.append(f"collective input {list(view_shape)} has no row dimension")
            elif cls is GemmAllToAllMatch and not _equal_splits(coll, view_shape[0], world):
                reasons.append("all_to_all_single with unequal split sizes is not supported")
            elif scatter_dim >= len(view_shape) - 1:
                reasons.append(f"scatter along the GEMM's N dimension (dim {scatter_dim}) is not supported")
            else:
                try:
                    stripes = RowStripes.from_view(view_shape, scatter_dim, world)
                except ValueError as e:
                    reasons.append(str(e))

    kw = dict(
        group_name=group,
        world_size=world or 0,
        dtype=v.dtype if v is not None else a.meta.get("val").dtype,
        graph=graph_name,
        unsupported="; ".join(reasons) or None,
        mm_node=mm,
        a_node=a,
        b_node=b,
        bias_node=bias,
        collective_node=coll,
        wait_node=wait,
        chain_nodes=chain,
        m=m_,
        n=n_,
        k=k_,
        view_shape=view_shape or (),
        stripes=stripes,
        reduce_op=reduce_op,
        extra_terms=extra_terms,
        output_fuses=consumers_fuse(wait),
    )
    if cls is GemmReduceScatterMatch:
        kw["scatter_dim"] = scatter_dim
        if not reasons and stripes is not None and stripes.outer == 1 and scatter_dim == 0:
            kw["subtile_ag_wait"] = _rowwise_path_to_allgather(wait, group, stripes.stripe_rows)
    return cls(**kw)


# Ops that act on each row independently (elementwise, or reducing the last dim only).
_ROWWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.rsqrt.default, aten.sqrt.default,
    aten.pow.Tensor_Scalar, aten.exp.default, aten.sigmoid.default, aten.silu.default, aten.relu.default,
    aten.tanh.default, aten.gelu.default, aten.mean.dim, aten.sum.dim_IntList,
    torch.ops.prims.convert_element_type.default,
}


def _is_rowwise(node: fx.Node, rows: int) -> bool:
    if node.op != "call_function" or node.target not in _ROWWISE:
        return False
    shape = static_shape(node)
    if shape is None or len(shape) < 1 or shape[0] != rows:
        return False
    if node.target in (aten.mean.dim, aten.sum.dim_IntList):
        dims = [d % len(static_shape(node.args[0])) for d in node.args[1]]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return dims == [len(shape) - 1] and bool(keep)
    return True


def _rowwise_path_to_allgather(start: fx.Node, group: str, rows: int) -> fx.Node | None:
    """The wait of the one all-gather (dim 0, ``group``) that ``start`` reaches through row-wise
    ops only, with no tensor operand from outside the path and no value escaping (no other
    reader, no graph output); None otherwise. Pure: only reads the graph."""
    path, frontier, ag_wait = {start}, [start], None
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in path:
                continue
            if is_call(user, c10d.all_gather_into_tensor.default):
                w = sole_wait(user)
                if ag_wait is not None or w is None or group_name_of(user.args[2]) != group:
                    return None
                ag_wait = w
                path.add(user)
                continue
            if not _is_rowwise(user, rows):
                return None
            path.add(user)
            frontier.append(user)
    for node in path:
        if node is start or is_call(node, c10d.all_gather_into_tensor.default):
            continue
        # Any other tensor operand rules the path out: rows change ranks in the subtile form, and
        # a tensor operand (even a row-broadcast one, like a norm weight) is not provably the same
        # on every rank. Python scalars are.
        if any(arg not in path for arg in node.all_input_nodes):
            return None
    return ag_wait


def _equal_splits(a2a: fx.Node, rows: int, world: int) -> bool:
    out_splits, in_splits = a2a.args[1], a2a.args[2]
    want = [rows // world] * world
    return rows % world == 0 and list(out_splits) == want and list(in_splits) == want


def _redo_gather_cat(wait: fx.Node, world: int) -> tuple[fx.Node, int, list[fx.Node]]:
    """``cat(split(wait, s, 0)[0..W-1], d)`` -> (cat, d, [split, getitems, cat]); else (wait, 0, [])."""
    users = list(wait.users)
    if len(users) == world and all(is_call(u, aten.slice.Tensor) for u in users):
        cat = single_user(users[0])
        if is_call(cat, aten.cat.default) and len(cat.args[0]) == world and _equal_slices(list(cat.args[0]), world) \
                and _equal_slices(list(cat.args[0]), world)[1] == 0 and set(cat.args[0]) == set(users):
            shape = static_shape(cat)
            d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
            return cat, d % len(shape) if shape else d, [*cat.args[0], cat]
    split = single_user(wait)
    if not is_call(split, (aten.split.Tensor, aten.split_with_sizes.default)):
        return wait, 0, []
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim != 0:
        return wait, 0, []
    items = getitems_of(split)
    if items is None or len(items) != world:
        return wait, 0, []
    cat = single_user(items[0])
    if not is_call(cat, aten.cat.default) or list(cat.args[0]) != items:
        return wait, 0, []
    if any(len(i.users) != 1 for i in items):
        return wait, 0, []
    shape = static_shape(cat)
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return cat, d % len(shape) if shape else d, [split, *items, cat]


def _allgather_gemm(ag: fx.Node, graph_name: str) -> Match | None:
    wait = sole_wait(ag)
    if wait is None:
        return None
    world = ag.args[1]
    group = group_name_of(ag.args[2])
    gathered, gather_dim, chain = _redo_gather_cat(wait, world)
    gshape = static_shape(gathered)

    # The [M, K] matrix: the gathered tensor itself when 2-D, else reached through view/reshape
    # nodes that keep the last dim (K): such views keep the row-major row order, e.g. with batch 1
    # [W*S/W... , K] -> [1, S, K] -> [S, K].
    matrix, flat_chain, twins = _flatten_rows(gathered)
    if matrix is None:
        return None
    consumers = []
    for view in (matrix, *twins):
        for u in view.users:
            if is_call(u, MM_OPS) and mm_operands(u)[0] is view and mm_operands(u)[3] is None:
                _, b, bias, _ = mm_operands(u)
                shape = static_shape(u)
                consumers.append(GemmConsumer(mm_node=u, b_node=b, bias_node=bias, n=shape[1] if shape else 0))
    if not consumers:
        return None  # an all-gather that feeds no GEMM rows is not a site

    reasons = []
    v = val(ag)
    if gshape is None or any(is_symbolic(c.mm_node) for c in consumers):
        reasons.append("symbolic shapes are not handled yet (compile with dynamic=False)")
    if v is not None and v.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {v.dtype} not supported (float32, bfloat16, float16 are)")
    if world < 2:
        reasons.append("world size 1: nothing to overlap")
    dtypes = {val(c.mm_node).dtype for c in consumers if val(c.mm_node) is not None}
    if len(dtypes) > 1:
        reasons.append(f"GEMMs of mixed dtypes {sorted(map(str, dtypes))}")
    stripes = None
    m_ = k_ = 0
    if not reasons:
        m_, k_ = _prod(gshape[:-1]), gshape[-1]
        if len(gshape) < 2 or gather_dim >= len(gshape) - 1:
            reasons.append(f"gather along the GEMM's K dimension (dim {gather_dim} of {list(gshape)}) is not supported")
        else:
            try:
                stripes = RowStripes.from_view(gshape, gather_dim, world)
            except ValueError as e:
                reasons.append(str(e))
    if stripes is None:
        stripes = RowStripes(1, max(world, 1), 1)
    return AllGatherGemmMatch(
        group_name=group,
        world_size=world,
        dtype=v.dtype if v is not None else None,
        graph=graph_name,
        unsupported="; ".join(reasons) or None,
        ag_node=ag,
        wait_node=wait,
        shard_node=ag.args[0],
        chain_nodes=chain + flat_chain,
        full_node=gathered,
        gathered_node=matrix,
        gathered_twins=twins,
        gathered_shape=gshape or (),
        gather_dim=gather_dim,
        consumers=consumers,
        m=m_,
        k=k_,
        stripes=stripes,
    )


def _flatten_rows(gathered: fx.Node) -> tuple[fx.Node | None, list[fx.Node], list[fx.Node]]:
    """Follow views that keep the last dim from ``gathered`` down to a 2-D node: (the 2-D node,
    the views on the way, its twins). Twins are further views to the same 2-D shape from the
    same node: an inference graph flattens ``[1, S, K]`` once per GEMM (the Q, K and V
    projections each read their own ``reshape(x, [S, K])``), a training graph once for all."""
    shape = static_shape(gathered)
    if shape is None:
        return None, [], []
    node, chain = gathered, []
    while len(shape) > 2:
        views = [u for u in node.users if is_call(u, VIEW_OPS) and static_shape(u) and static_shape(u)[-1] == shape[-1]]
        if chain and len(node.users) != len(views):
            return None, [], []  # an intermediate view read elsewhere: not a plain flattening
        shapes = {tuple(static_shape(v)) for v in views}
        if len(views) > 1 and len(shapes) == 1 and len(next(iter(shapes))) == 2:
            chain.extend(views)
            return views[0], chain, views[1:]
        if len(views) != 1:
            return None, [], []
        node = views[0]
        chain.append(node)
        shape = static_shape(node)
    return node, chain, []


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
