"""Give every collective left in the graph compute to hide behind: the work that does not lead to
it moves from before its start to between its start and its wait, and the wait to just before the
first node that reads the result. A backward's weight gradients (``dW = X^T @ dY``) feed no
collective, yet AOTAutograd places them before the data gradient's reduce-scatter. Before (a Llama
MLP's backward, ``mm_9`` and ``mm_11`` the weight gradients of W1 and W3)::

    mm_9 = mm(permute_15, view_16);  mm_10 = mm(view_28, permute_17)
    mm_11 = mm(permute_19, view_16); mm_12 = mm(view_31, permute_21)
    cat_5 = cat([..mm_10.., ..mm_12..])
    rs = reduce_scatter_tensor(cat_5, 'sum', 2, '0');  w = wait_tensor(rs)
    ...first reader of w...

After::

    mm_10 = mm(view_28, permute_17);  mm_12 = mm(view_31, permute_21);  cat_5 = cat([...])
    rs = reduce_scatter_tensor(cat_5, 'sum', 2, '0')
    mm_9 = mm(permute_15, view_16);  mm_11 = mm(permute_19, view_16)      # beside the collective
    ...
    w = wait_tensor(rs)
    ...first reader of w...

Only pure ops move (no mutation, seeded randomness, collective or wait), and only within the
stretch since the previous collective's start, so every node still follows its inputs. Sites a
template rewrote are ops of their own and are not touched.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .graph_utils import c10d, group_name_of, is_call, val, world_size_of

_COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"}


@dataclasses.dataclass
class Deferral:
    """One collective: what moved under it (node names) and how many of them are GEMMs."""

    collective: str
    moved: list[str]
    gemms: int

    def describe(self) -> str:
        return f"{self.collective}: {len(self.moved)} nodes ({self.gemms} GEMMs) moved between its start and its wait"


def is_collective(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and n.target._opname in _COLLECTIVES)


def is_wait(n: fx.Node) -> bool:
    return is_call(n, c10d.wait_tensor.default)


def _movable(n: fx.Node) -> bool:
    if n.op != "call_function" or is_collective(n) or is_wait(n):
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return target.namespace in ("aten", "prims")
    return target is operator.getitem


def _gemm(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._opname in ("mm", "addmm", "bmm", "baddbmm")


# How much GEMM work a collective gets under it: FLOPs per byte it moves. H100 / H200 bf16 dense
# peak ~990 TFLOP/s over ~300 GB/s of effective NVLink collective bandwidth per direction is
# ~3300; twice that, as the GEMM and the collective slow each other while they share the GPU
# (README: NCCL 1.4-1.6x slower beside a GEMM). The rest waits for the next collective.
FLOPS_PER_BYTE = 2 * 3300.0


def defer_independent_compute(graph: fx.Graph, flops_per_byte: float = FLOPS_PER_BYTE) -> list[Deferral]:
    """Rewrite the order of ``graph`` in place (see the module doc); one Deferral per collective
    that got work under it. A collective takes the independent work before it, in order, until
    its GEMMs reach ``flops_per_byte`` times the bytes it moves; what is left is moved past its
    wait, where the next collective can take it."""
    done: list[Deferral] = []
    region_start = 0
    for start in [n for n in graph.nodes if is_collective(n)]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        region = [n for n in graph.nodes if region_start <= order[n] < order[start]]
        moving = _independent(start, region)
        nbytes = comm_bytes(start)  # 0: not known (no shapes): it takes all of it
        need, got, under = flops_per_byte * nbytes if nbytes else float("inf"), 0.0, []
        for n in moving:
            if got >= need:
                break
            under.append(n)
            got += gemm_flops(n)
        later = moving[len(under):]
        anchor = start
        for n in under:
            anchor.append(n)
            anchor = n
        waits = [u for u in start.users if is_wait(u)]
        for w in waits:
            _sink(graph, w)
        boundary = anchor = waits[-1] if waits else anchor
        for n in later:  # after the wait: the next collective's region
            anchor.append(n)
            anchor = n
        if under:
            done.append(Deferral(start.name, [n.name for n in under], sum(_gemm(n) for n in under)))
        region_start = {n: i for i, n in enumerate(graph.nodes)}[boundary] + 1
    graph.lint()
    return done


def deferrable(graph: fx.Graph, flops_per_byte: float = FLOPS_PER_BYTE) -> dict[str, list[fx.Node]]:
    """What ``defer_independent_compute`` would move under each collective of ``graph`` if every
    site were left as written: collective name -> the GEMM nodes (of ``graph``) it would get.
    ``graph`` is not touched (the pass runs on a copy)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    by_name = {n.name: n for n in graph.nodes}
    if any(n.name not in by_name for n in copy.nodes):  # names must map back one to one
        return {}
    return {d.collective: [by_name[m] for m in d.moved if _gemm(by_name[m])]
            for d in defer_independent_compute(copy, flops_per_byte)}


def _independent(start: fx.Node, region: list[fx.Node]) -> list[fx.Node]:
    """The nodes of ``region`` (before ``start``) that may move past it: movable, not feeding it,
    and not read by a node that stays."""
    feeds = _ancestors(start, set(region))
    moving = {n for n in region if n not in feeds and _movable(n)}
    for n in region:
        if n not in moving and any(i in moving for i in n.all_input_nodes):
            moving -= _ancestors(n, moving)
    return [n for n in region if n in moving]


def comm_bytes(start: fx.Node) -> float:
    """Bytes a rank sends in this collective (the larger of its input and output, times
    (W - 1) / W; twice that for an all-reduce)."""
    sizes = [v.numel() * v.element_size() for v in (val(start), val(start.args[0]))
             if isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape)]
    if not sizes:
        return 0.0
    world = None
    for a in start.args[1:]:
        if isinstance(a, int) and not isinstance(a, bool):
            world = a
    if world is None:
        try:
            world = world_size_of(group_name_of(start.args[-1]))
        except ValueError:
            world = None
    world = world or 2
    share = max(sizes) * (world - 1) / world
    return 2 * share if start.target._opname == "all_reduce" else share


def gemm_flops(n: fx.Node) -> float:
    if not _gemm(n):
        return 0.0
    out, a = val(n), val(n.args[-2] if n.target._opname in ("addmm", "baddbmm") else n.args[0])
    if not (isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor)):
        return 0.0
    from .symbolic_sizes import hint  # int() of a symbolic size would pin it (a guard)

    return 2.0 * hint(out.numel()) * hint(a.shape[-1])


def gemm_shape(n: fx.Node) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of a GEMM node with static shapes, else None."""
    if not _gemm(n):
        return None
    out, a = val(n), val(n.args[-2] if n.target._opname in ("addmm", "baddbmm") else n.args[0])
    if not (isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor)) or out.dim() not in (2, 3):
        return None
    dims = (*out.shape, a.shape[-1])
    if not all(isinstance(d, int) for d in dims):
        return None
    return (1, *dims) if out.dim() == 2 else tuple(dims)  # type: ignore[return-value]


def _ancestors(node: fx.Node, within: set) -> set:
    """The nodes of ``within`` that ``node`` reads, directly or through others of ``within``."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen or n not in within:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _sink(graph: fx.Graph, wait: fx.Node) -> None:
    """Move ``wait`` to just before its first reader (it stays after everything before it)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = sorted(wait.users, key=order.__getitem__)
    if readers and order[readers[0]] > order[wait] + 1:
        readers[0].prepend(wait)
