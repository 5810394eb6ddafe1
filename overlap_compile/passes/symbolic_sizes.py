"""Reading symbolic sizes without guarding on them.

A post-grad graph compiled with dynamic shapes carries ``SymInt`` sizes. Any ``int(s)``, ``s == 3``
or ``s % 2`` on one adds a guard to the compile's shape environment, and a guard that pins a size
to its example value makes Dynamo specialise (or, under ``mark_dynamic``, fail with a constraint
violation). Code of the pass reads sizes through these helpers instead: ``hint`` is the example
value (the compile's size hint, no guard), ``expr`` the sympy expression, ``static`` an int only
where the size is one.
"""
from __future__ import annotations

from typing import Any

import torch


def is_sym(x: Any) -> bool:
    return isinstance(x, torch.SymInt)


def hint(x: Any, fallback: int = 0) -> int:
    """An int size, or a SymInt's example value (no guard); ``fallback`` when it has none."""
    if isinstance(x, int):
        return x
    if is_sym(x):
        h = getattr(x.node, "hint", None)
        if h is not None:
            return int(h)
        return fallback
    return fallback


def expr(x: Any) -> Any:
    """The sympy expression of a size (an Integer for an int)."""
    import sympy

    if is_sym(x):
        return x.node.expr
    return sympy.Integer(int(x))


def shape_exprs(shape: Any) -> tuple:
    return tuple(expr(s) for s in shape)


def symbols_of(x: Any) -> set:
    """The free symbols of a size (empty for an int)."""
    return set(expr(x).free_symbols) if is_sym(x) else set()


def same(a: Any, b: Any) -> bool:
    """Whether two sizes are provably equal, by their expressions (no guard). Two ints are
    compared as ints: the static finder reads its sizes through this too."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    import sympy

    return sympy.simplify(expr(a) - expr(b)) == 0


def same_shape(a: Any, b: Any) -> bool:
    """Whether two shapes are provably equal, size by size; an unknown shape (None) matches only
    another unknown one, as tuple equality has it."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def shape_env_of(*sizes: Any) -> Any:
    for s in sizes:
        if is_sym(s):
            return s.node.shape_env
    return None


def value_range(x: Any) -> tuple[int, int | None]:
    """(lower, upper) bound the compile knows for a size; upper None when unbounded."""
    if not is_sym(x):
        return int(x), int(x)
    try:
        vr = x.node.shape_env.bound_sympy(x.node.expr)
    except Exception:  # a bound the environment cannot work out: the size alone says nothing
        return 0, None
    return _int_or(vr.lower, 0), _int_or(vr.upper, None)


def _int_or(bound: Any, default: Any) -> Any:
    try:  # an infinite bound (int_oo) has no int
        return int(bound)
    except Exception:
        return default


# ---- symbolic sizes as graph nodes -------------------------------------------------------------

def size_arg(before: Any, size: Any, emit: Any = None) -> Any:
    """``size`` as an argument of a node inserted before ``before``: an int, a node earlier in the
    graph holding the same expression, or (with ``emit``, a passes.graph_utils.GraphEmitter
    inserting before ``before``) arithmetic on the nodes of its symbols. Without ``emit``: a dry
    run, None where the size cannot be built. A view given such sizes has exactly the shape the
    graph's other nodes have, so Inductor proves it equal without a guard."""
    if not is_sym(size):
        return int(size)
    return _build(before, expr(size), emit)


def read_sizes_from_inputs(graph: Any, node: Any) -> None:
    """Re-point the graph's size reads of ``node`` (``sym_size`` / ``sym_numel`` / ``sym_stride``
    on it) to the same sizes computed from the graph's inputs, where they can be. A dynamic
    compile reads the all-gather's output sizes off that tensor: kept, such a read would keep the
    gathered matrix alive after the rewrite, and the op would write it out for nothing."""
    from .graph_utils import GraphEmitter

    aten = torch.ops.aten
    for user in list(node.users):
        if user.target not in (aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int):
            continue
        size = user.meta.get("val")
        if size is None or size_arg(user, size) is None:
            continue  # not buildable from the inputs: the read stays
        user.replace_all_uses_with(size_arg(user, size, GraphEmitter(graph, before=user)))
        graph.erase_node(user)


def _earlier(before: Any):
    node = before.prev
    while node.op != "root":
        yield node
        node = node.prev


def _node_holding(before: Any, e: Any) -> Any:
    for node in _earlier(before):
        v = node.meta.get("val")
        if is_sym(v) and v.node.expr == e and _of_inputs(node):
            return node
    return None


def _of_inputs(node: Any) -> bool:
    """Whether a size node is computed from the graph's inputs alone (a SymInt input, a size of an
    input tensor, arithmetic on those). Only such a node may size a rewritten site: a size read
    off a tensor the graph computes (the all-gather's output, say) can come to depend on the very
    op it would size once the rewrite replaces that tensor, and the graph would hold a cycle."""
    if not hasattr(node, "op"):
        return True  # an int or a sympy constant
    if node.op == "placeholder":
        return True
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.sym_size.int:
        return node.args[0].op == "placeholder"
    import operator

    if node.target not in (operator.mul, operator.add, operator.sub, operator.floordiv, operator.neg):
        return False
    return all(_of_inputs(a) for a in node.args)


def _tensor_dim_holding(before: Any, e: Any) -> tuple[Any, int] | None:
    for node in _earlier(before):  # graph inputs only: the site's own nodes are erased by the rewrite
        v = node.meta.get("val")
        if node.op == "placeholder" and isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if is_sym(s) and s.node.expr == e:
                    return node, d
    return None


def _build(before: Any, e: Any, emit: Any) -> Any:
    import operator

    import sympy
    from torch.utils._sympy.functions import FloorDiv

    if e.is_Integer:
        return int(e)
    found = _node_holding(before, e)
    if found is not None:
        return found
    if e.is_Symbol:
        at = _tensor_dim_holding(before, e)
        if at is None or emit is None:
            return at and True
        return emit(torch.ops.aten.sym_size.int, at[0], at[1])
    if isinstance(e, (sympy.Mul, sympy.Add)):
        op = operator.mul if isinstance(e, sympy.Mul) else operator.add
        parts = [_build(before, x, emit) for x in e.args]
    elif isinstance(e, FloorDiv):
        op = operator.floordiv
        parts = [_build(before, x, emit) for x in e.args]
    else:
        return None
    if any(p is None for p in parts):
        return None
    if emit is None:
        return True
    out = parts[0]
    for p in parts[1:]:
        out = emit(op, out, p)
    return out
