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
    aten,
    c10d,
    consumers_fuse,
    gemm_terms,
    group_name_of,
    is_call,
    is_symbolic,
    mm_operands,
    sole_wait,
    static_shape,
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
    STATIC,
    dtype_world_reasons,
    equal_splits,
    escaping_use,
    gathered_rows,
    mixed_dtypes,
    prod,
    summed_terms,
    undo_scatter_split,
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
        undone = undo_scatter_split(src, world, STATIC)
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
    reasons = [problem] if problem else []
    extra_terms, summed_problems = summed_terms(mms, bias, STATIC)
    reasons += summed_problems
    chain = [*split_nodes, *views]
    reasons += escaping_use([*mms, *views], chain, coll)
    if any(is_symbolic(n) for n in (mm, a, b, coll)) or view_shape is None:
        reasons.append("symbolic shapes are not handled yet (compile with dynamic=False)")
    reasons += dtype_world_reasons(v.dtype if v is not None else None, world, group)

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
            elif cls is GemmAllToAllMatch and not equal_splits(coll, view_shape[0], world):
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


def _allgather_gemm(ag: fx.Node, graph_name: str) -> Match | None:
    site = gathered_rows(ag, STATIC)
    if site is None:
        return None
    wait, world, group, gathered, gather_dim, chain, matrix, twins, consumers = site
    gshape = static_shape(gathered)
    reasons = []
    v = val(ag)
    if gshape is None or any(is_symbolic(c.mm_node) for c in consumers):
        reasons.append("symbolic shapes are not handled yet (compile with dynamic=False)")
    reasons += dtype_world_reasons(v.dtype if v is not None else None, world, group)
    reasons += mixed_dtypes(consumers)
    stripes = None
    m_ = k_ = 0
    if not reasons:
        m_, k_ = prod(gshape[:-1]), gshape[-1]
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
        chain_nodes=chain,
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
