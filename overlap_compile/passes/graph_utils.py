"""Small helpers for reading and writing Inductor post-grad FX graphs."""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
MM_OPS = (aten.mm.default, aten.addmm.default)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_call(node: Any, ops: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    return node.target in ops if isinstance(ops, tuple) else node.target == ops


def is_zero_fill(node: Any) -> bool:
    """A tensor of zeros made from nothing: ``full(size, 0)``, ``zeros`` or ``new_zeros``."""
    if is_call(node, aten.full.default):
        return node.args[1] == 0
    return is_call(node, (aten.zeros.default, aten.new_zeros.default))


def val(node: fx.Node) -> Any:
    return node.meta.get("val")


def static_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The node's shape as ints, or None when unknown or symbolic."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return None
    if not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def is_symbolic(node: fx.Node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)


def group_name_of(arg: Any) -> str:
    """Group names appear as str (2.11) or may be ProcessGroup objects (2.13 schemas say Any)."""
    if isinstance(arg, str):
        return arg
    name = getattr(arg, "group_name", None)
    if isinstance(name, str):
        return name
    raise ValueError(f"cannot read a process-group name from {arg!r}")


def world_size_of(group_name: str) -> int | None:
    """Size of the named group, or None when no such group exists in this process."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name).size()
    except Exception:
        return None


def mm_operands(mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, str | None]:
    """(a, b, bias, problem) of an mm/addmm node; problem is a reason when unsupported."""
    if mm.target == aten.mm.default:
        return mm.args[0], mm.args[1], None, None
    bias, a, b = mm.args[:3]
    beta = mm.kwargs.get("beta", 1)
    alpha = mm.kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1:
        return a, b, bias, f"addmm with beta={beta}, alpha={alpha} (only 1, 1 supported)"
    bshape = static_shape(bias)
    if bshape is None or len(bshape) != 1:
        return a, b, bias, f"addmm bias of shape {bshape} (only a 1-D bias over N supported)"
    return a, b, bias, None


# Reductions Inductor fuses a strided read of their input into (besides pointwise ops).
FUSING_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                     aten.var_mean.correction, aten.var.correction)


def consumers_fuse(node: fx.Node) -> bool:
    """Whether every reader of ``node`` (through views) is a pointwise op or a reduction, i.e.
    an Inductor kernel that reads a permuted view of it in place: a template whose output is
    that permuted view (signal_reorder's tile order) then costs no extra pass. False when any
    reader is a GEMM, a collective, a custom op, the graph output, or anything else that
    needs the tensor materialised."""
    readers = list(node.users)
    if not readers:
        return False
    for user in readers:
        if is_call(user, VIEW_OPS):
            if not consumers_fuse(user):
                return False
            continue
        if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
            return False
        if not (torch.Tag.pointwise in user.target.tags or user.target in FUSING_REDUCTIONS):
            return False
    return True


def users(node: fx.Node) -> list[fx.Node]:
    return list(node.users)


def single_user(node: fx.Node) -> fx.Node | None:
    us = list(node.users)
    return us[0] if len(us) == 1 else None


def sole_wait(collective: fx.Node) -> fx.Node | None:
    """The collective's wait_tensor when that is its only user."""
    u = single_user(collective)
    return u if is_call(u, c10d.wait_tensor.default) else None


def walk_back_views(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Follow view/reshape producers back; returns (first non-view node, views passed)."""
    chain = []
    while is_call(node, VIEW_OPS):
        chain.append(node)
        node = node.args[0]
    return node, chain


def gemm_terms(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """``view*(mm)`` or ``view*(add(view*(mm), view*(mm)), ...)`` -> (mm nodes, views/adds between);
    None when anything else produces the tensor."""
    base, views = walk_back_views(node)
    if is_call(base, MM_OPS):
        return [base], views
    if is_call(base, aten.add.Tensor) and len(base.args) == 2 and base.kwargs.get("alpha", 1) == 1:
        left, right = (gemm_terms(x) if isinstance(x, fx.Node) else None for x in base.args)
        if left and right:
            return left[0] + right[0], views + [base] + left[1] + right[1]
    return None


def after_inputs(graph: fx.Graph, inputs: list[fx.Node]) -> fx.Node:
    """The node right after the last of ``inputs``: the earliest place a template can start
    (weights are often permuted only after the gather or the first GEMM)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(inputs, key=lambda n: order[n]).next


def getitems_of(split: fx.Node) -> list[fx.Node] | None:
    """The getitem users of a split, ordered by index, or None if anything else reads it."""
    items = {}
    for u in split.users:
        if not (u.op == "call_function" and u.target == operator.getitem):
            return None
        items[u.args[1]] = u
    return [items[i] for i in sorted(items)]


class GraphEmitter:
    """Inserts aten calls before an anchor node, filling ``meta['val']`` by running the op on
    the inputs' fake tensors (as Inductor's own passes do)."""

    def __init__(self, graph: fx.Graph, before: fx.Node) -> None:
        self.graph = graph
        self.before = before
        self.new_nodes: list[fx.Node] = []
        self._fake_mode = _fake_mode_of(graph)

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(op, tuple(args), dict(kwargs))
        fake_args = tree_map(lambda a: val(a) if isinstance(a, fx.Node) else a, (args, kwargs))
        with self._fake_mode:
            node.meta["val"] = op(*fake_args[0], **fake_args[1])
        if op is not operator.getitem:
            node.meta["overlap_compile"] = True
        self.new_nodes.append(node)
        return node


def _fake_mode_of(graph: fx.Graph) -> Any:
    from torch._guards import detect_fake_mode

    vals = [val(n) for n in graph.nodes if isinstance(val(n), torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def erase_if_dead(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the given nodes (in reverse topological order) once nothing reads them."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=lambda n: -order.get(n, -1)):
        if node.graph is graph and not node.users:
            graph.erase_node(node)


# the functional collectives a site can be built around
COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default,
               c10d.all_to_all_single.default)


def size_reads_after_waits(graph: fx.Graph) -> int:
    """Point ``aten.sym_size`` reads of a collective's output at its wait instead (the same shape),
    so that the wait is the collective's only user, as the finder asks; returns how many moved.

    A symbolic graph traces ``s, b, _ = gathered.shape`` as ``sym_size(all_gather, 0)``. A read moves
    only when everything that uses it comes after the wait; static graphs have no such reads."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for coll in [n for n in graph.nodes if is_call(n, COLLECTIVES)]:
        waits = [u for u in coll.users if is_call(u, c10d.wait_tensor.default)]
        sizes = [u for u in coll.users if is_call(u, aten.sym_size.int)]
        if len(waits) != 1 or not sizes or len(waits) + len(sizes) != len(coll.users):
            continue
        wait = waits[0]
        for read in sizes:
            if all(order[u] > order[wait] for u in read.users):
                wait.append(read)  # the read now runs right after the wait
                read.replace_input_with(coll, wait)
                moved += 1
    return moved
