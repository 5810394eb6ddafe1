"""Checks an expert-parallel section's finder runs on small probes, shared by the forward
(find_moe.py) and the backward (find_moe_backward.py) section: the view chains around the
experts, the token layout they produce, and small pointwise regions run node by node.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from .graph_utils import is_call, static_shape

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
         aten.transpose.int, aten.clone.default, aten.contiguous.default)
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
MAX_NODES = 400  # the most nodes a section's walks visit: a section is a layer's FFN, not a whole model


def wait_of(node: fx.Node) -> fx.Node | None:
    for u in node.users:
        if is_call(u, c10d.wait_tensor.default):
            return u
    return None


def view_chain(start: fx.Node, end: fx.Node) -> list[fx.Node] | None:
    """The view-like nodes from ``start`` (exclusive) to ``end`` (inclusive), each feeding the next."""
    chain, node = [], end
    while node is not start:
        if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS and node.args):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def moves_whole_rows(chain: list[fx.Node], hidden: int) -> bool:
    """Every tensor of the chain (its input too) ends in a dimension of ``hidden`` that stays
    last: reshapes keep the last size (row-major, so each length-``hidden`` row stays one
    row) and permutes / transposes never move the last dimension. Then the chain only
    permutes rows, and running it on one number per row (``run_chain(.., hidden)``) shows
    which permutation."""
    for n in [chain[0].args[0], *chain] if chain else []:
        shape = static_shape(n)
        if shape is None or len(shape) < 2 or shape[-1] != hidden:
            return False
    for n in chain:
        nd = len(static_shape(n.args[0]))
        if n.target is aten.permute.default and list(n.args[1])[-1] % nd != nd - 1:
            return False
        if n.target is aten.transpose.int and nd - 1 in (n.args[1] % nd, n.args[2] % nd):
            return False
    return True


def run_chain(chain: list[fx.Node], x: torch.Tensor, hidden: int) -> torch.Tensor:
    """The chain on ``x`` whose last dimension stands for a whole row of ``hidden``: reshape
    sizes get 1 in its place."""
    for n in chain:
        args = n.args[1:]
        if n.target in _RESHAPES:
            size = list(args[0])
            if size and size[-1] == hidden:
                size[-1] = 1
            args = (size, *args[1:])
        x = n.target(x, *args, **n.kwargs)
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1), b.reshape(-1))


def source_layout(wait: fx.Node, expert_in: fx.Node, expert_out: fx.Node, combine_in: fx.Node, world: int,
                  e_local: int, cap: int, hidden: int) -> tuple[list[fx.Node], list[fx.Node]] | str:
    """The view chains wait -> ``expert_in`` and ``expert_out`` -> ``combine_in`` when they lay
    the tokens out [W * E_local * C, H] -> [W, E_local, C, H] -> [E_local, W * C, H] and back
    (demo.moe's layout, both directions of a training step), else why not (a phrase)."""
    chain_in = view_chain(wait, expert_in)
    chain_out = view_chain(expert_out, combine_in)
    if chain_in is None or chain_out is None:
        return "the layout between the all-to-alls and the experts is not a chain of views"
    if not (moves_whole_rows(chain_in, hidden) and moves_whole_rows(chain_out, hidden)):
        return "the layout between the all-to-alls and the experts does not keep each token's row whole"
    # Whole rows: the layout is a permutation of rows, seen on one number per row (a probe of the
    # full [W * E_local * C, H] took ~1 s of compile time on an 8x7B-sized block).
    probe = torch.arange(world * e_local * cap, dtype=torch.float32).view(world * e_local * cap, 1)
    expected = probe.view(world, e_local, cap, 1).transpose(0, 1).reshape(e_local, world * cap, 1)
    if not same(run_chain(chain_in, probe, hidden), expected) or not same(run_chain(chain_out, expected, hidden), probe):
        return "tokens are not laid out [source rank, local expert, slot] around the experts"
    return chain_in, chain_out


def nodes_back(outs: list[fx.Node], is_leaf: Callable[[fx.Node], bool], limit: int
               ) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(the nodes computing ``outs`` back to the leaves, in graph order; the leaves in graph
    order): a walk back through the inputs of every node that is not a leaf. None past
    ``limit`` nodes or where a non-leaf is no call_function."""
    nodes, leaves, seen, todo = [], [], set(), list(outs)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_leaf(n):
            leaves.append(n)
            continue
        if n.op != "call_function" or len(nodes) >= limit:
            return None
        nodes.append(n)
        todo += list(n.all_input_nodes)
    order = {n: i for i, n in enumerate(outs[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__), sorted(leaves, key=order.__getitem__)


def run_nodes(nodes: list[fx.Node], env: dict) -> dict | None:
    """``env`` (node -> value: the leaves' probes) extended by running ``nodes`` (in graph order)
    on it; None when one of them cannot run on the probes."""
    env = dict(env)
    try:
        for n in nodes:
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
    except (KeyError, RuntimeError, TypeError):
        return None
    return env
