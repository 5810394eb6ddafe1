"""Find expert-parallel MoE sections: all_to_all -> expert GEMMs -> all_to_all.

Forward graphs of a layer such as overlap_compile.demo.moe hold::

    a2a_d = all_to_all_single(dispatch_buffer) ; w_d = wait_tensor(a2a_d)
    h = view/permute(w_d) ; y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2)
    a2a_c = all_to_all_single(view/permute(y)) ; wait_tensor(a2a_c)

and backward graphs the mirror image (the gradient of the combine is all-to-all'd back, goes
through the bmm gradients, and the gradient of the dispatch is all-to-all'd again). The finder
walks forward from a waited all_to_all through anything but a collective, and reports a section
when it reaches a second all_to_all of the same group with at least two bmm on the way.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import is_call, static_shape, val
from ..templates.plans import MOE_SAVE_ROLES as SAVE_ROLES  # the intermediates moe_fused can return
from .matches import MoeSectionMatch

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MAX_NODES = 400  # a section is a layer's FFN, not a whole model


def _wait_of(node: fx.Node) -> fx.Node | None:
    for u in node.users:
        if is_call(u, c10d.wait_tensor.default):
            return u
    return None


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") in ("_c10d_functional",
                                                                                  "_c10d_functional_autograd")


def moe_section(a2a: fx.Node, group: str, world: int, graph_name: str) -> MoeSectionMatch | None:
    wait = _wait_of(a2a)
    if wait is None:
        return None
    seen, frontier, bmms, combine = {wait}, [wait], [], None
    while frontier and len(seen) < MAX_NODES:
        node = frontier.pop()
        for u in node.users:
            if u in seen or u.op != "call_function":
                continue
            if is_call(u, c10d.all_to_all_single.default):
                if u.args[3] == group and combine is None:
                    combine = u
                continue
            if _is_collective(u):
                continue
            seen.add(u)
            if is_call(u, aten.bmm.default):
                bmms.append(u)
            frontier.append(u)
    if combine is None or len(bmms) < 2:
        return None
    shapes = []
    for b in bmms:
        x, y = static_shape(b.args[0]), static_shape(b.args[1])
        if x is None or y is None:
            return None
        shapes.append((x[0], x[1], y[2], x[2]))
    inp = static_shape(a2a.args[0])
    dtype = val(a2a.args[0]).dtype
    nbytes = (int(torch.tensor(inp).prod()) if inp else 0) * torch.empty((), dtype=dtype).element_size()
    m = MoeSectionMatch(
        group_name=group, world_size=world, dtype=dtype, graph=graph_name, unsupported=None,
        dispatch_node=a2a, combine_node=combine, bmm_nodes=bmms, bmm_shapes=shapes, dispatch_bytes=nbytes)
    m.dispatch_wait = wait
    m.unsupported = _uneven_splits(m) or _swiglu_roles(m, wait)
    return m


def _uneven_splits(m: MoeSectionMatch) -> str | None:
    """moe_fused cuts each rank's rows into W equal pieces: both all-to-alls must have static,
    equal splits (a dropless / token-count-sized dispatch has data-dependent ones)."""
    for role, node in (("dispatch", m.dispatch_node), ("combine", m.combine_node)):
        shape = static_shape(node.args[0])
        outs, ins = node.args[1], node.args[2]
        w = m.world_size
        equal = (shape is not None and w > 0 and shape[0] % w == 0 and isinstance(outs, (list, tuple))
                 and isinstance(ins, (list, tuple)) and list(outs) == list(ins) == [shape[0] // w] * w)
        if not equal:
            return (f"expert-parallel MoE section ({len(m.bmm_nodes)} expert bmm between two all-to-alls): "
                    f"the {role} all-to-all has uneven or dynamic splits (out {list(outs) if isinstance(outs, (list, tuple)) else outs}, "
                    f"in {list(ins) if isinstance(ins, (list, tuple)) else ins}); moe_fused needs equal static splits")
    return None


VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
         aten.transpose.int, aten.clone.default, aten.contiguous.default)


def _swiglu_roles(m: MoeSectionMatch, wait: fx.Node) -> str | None:
    """Fill the SwiGLU roles of ``m`` (demo.moe's form) and return None, or say why not:
    h = layout(wait_d); y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2); combine(layout^-1(y)), where
    layout is [W * E_local * C, H] -> [W, E_local, C, H] -> [E_local, W * C, H] (checked by running
    the view chains on a probe tensor), nothing in between used outside the section."""
    generic = (f"expert-parallel MoE section ({len(m.bmm_nodes)} expert bmm between two all-to-alls)")
    if len(m.bmm_nodes) != 3:
        return f"{generic}: moe_fused takes the SwiGLU form (3 bmm); this one is not it"
    down = [b for b in m.bmm_nodes if is_call(b.args[0], aten.mul.Tensor)]
    if len(down) != 1:
        return f"{generic}: no bmm(silu(x @ w1) * (x @ w3), w2) found"
    b2 = down[0]
    mul = b2.args[0]
    ups = [b for b in m.bmm_nodes if b is not b2]
    b3 = next((b for b in ups if b in mul.args), None)
    b1 = next((b for b in ups if b is not b3), None)
    act = _activation(b1, mul, b3) if b1 is not None and b3 is not None else None
    if act is None or b1.args[0] is not b3.args[0]:
        return f"{generic}: the two up-projections do not share their input through silu(.) * (.)"
    h = b1.args[0]
    w, combine_in = m.world_size, m.combine_node.args[0]
    hs, ws = static_shape(h), static_shape(wait)
    if hs is None or ws is None or len(hs) != 3 or w < 1 or hs[1] % w:
        return f"{generic}: expert input shape {hs} is not [E_local, W * C, H]"
    e_local, cap, hidden = hs[0], hs[1] // w, hs[2]
    chain_in = _view_chain(wait, h)
    chain_out = _view_chain(b2, combine_in)
    if chain_in is None or chain_out is None:
        return f"{generic}: the layout between the all-to-alls and the experts is not a chain of views"
    if not (_moves_whole_rows(chain_in, hidden) and _moves_whole_rows(chain_out, hidden)):
        return f"{generic}: the layout between the all-to-alls and the experts does not keep each token's row whole"
    # Whole rows: the layout is a permutation of rows, seen on one number per row (a probe of the
    # full [W * E_local * C, H] took ~1 s of compile time on an 8x7B-sized block).
    probe = torch.arange(w * e_local * cap, dtype=torch.float32).view(w * e_local * cap, 1)
    expected_h = probe.view(w, e_local, cap, 1).transpose(0, 1).reshape(e_local, w * cap, 1)
    if not _same(_run_chain(chain_in, probe, hidden), expected_h) or \
            not _same(_run_chain(chain_out, expected_h, hidden), probe):
        return f"{generic}: tokens are not laid out [source rank, local expert, slot] around the experts"
    section = [wait, *chain_in, b1, b3, *act, mul, b2, *chain_out, m.combine_node]
    combine_wait = _wait_of(m.combine_node)
    inside = set(section) | {combine_wait}
    # What a training graph saves for backward: the experts' input, both up-projections and the
    # activation product. moe_fused returns those too (MoePlan.saves); anything else escaping
    # the section would have to be recomputed, so such a section is left as written.
    savable = {h: "tokens", b1: "gate", b3: "up", mul: "act"}
    saved = {}
    for n in section:
        outside = [u.name for u in n.users if u not in inside]
        if outside and n in savable:
            saved[savable[n]] = n
        elif outside:
            return (f"{generic}: {n.name} is also used by {outside}: moe_fused replaces the whole section and "
                    f"can hand out only the expert input, the two up-projections and the activation product "
                    f"(what a training graph saves), not this")
    m.saved_nodes = {role: saved[role] for role in SAVE_ROLES if role in saved}
    m.buffer_node, m.weight_nodes, m.combine_wait = m.dispatch_node.args[0], (b1.args[1], b3.args[1], b2.args[1]), combine_wait
    m.section_nodes, m.e_local, m.capacity, m.hidden = section, e_local, cap, hidden
    m.ffn = static_shape(b1)[2]
    return None


def _activation(b1: fx.Node, mul: fx.Node, b3: fx.Node) -> list[fx.Node] | None:
    """The nodes computing ``mul``'s other operand from ``b1``, if they compute silu (Inductor
    decomposes it, e.g. into b1 / (exp(-b1) + 1)): checked by running them on a probe."""
    other = [a for a in mul.args if a is not b3]
    if len(other) != 1 or not isinstance(other[0], fx.Node):
        return None
    nodes, seen, todo = [], set(), [other[0]]
    while todo:  # walk back from the operand to b1
        n = todo.pop()
        if n is b1 or n in seen:
            continue
        if n.op != "call_function" or len(nodes) > 16:
            return None
        seen.add(n)
        nodes.append(n)
        todo += [a for a in n.all_input_nodes]
    order = {n: i for i, n in enumerate(b1.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    # the probe in the section's dtype: with bf16 / fp16 Inductor's decomposition casts to fp32
    # and back, so the result is silu rounded to that dtype
    dtype = val(b1).dtype if val(b1) is not None else torch.float32
    probe = torch.linspace(-6, 6, 97).to(dtype)
    env = {b1: probe}
    try:
        for n in nodes:
            args = torch.fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
    except (KeyError, RuntimeError, TypeError):
        return None
    got = env.get(other[0]) if other[0] is not b1 else probe
    want = torch.nn.functional.silu(probe.float())
    rtol = 2 * torch.finfo(dtype).eps  # two roundings at most (the cast back, the division)
    if got is None or not torch.allclose(got.float(), want, rtol=rtol, atol=1e-6):
        return None
    return nodes


def _view_chain(start: fx.Node, end: fx.Node) -> list[fx.Node] | None:
    """The view-like nodes from ``start`` (exclusive) to ``end`` (inclusive), each feeding the next."""
    chain, node = [], end
    while node is not start:
        if not (node.op == "call_function" and node.target in VIEWS and node.args):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _moves_whole_rows(chain: list[fx.Node], hidden: int) -> bool:
    """Every tensor of the chain (its input too) ends in a dimension of ``hidden`` that stays
    last: reshapes keep the last size (row-major, so each length-``hidden`` row stays one
    row) and permutes / transposes never move the last dimension. Then the chain only
    permutes rows, and running it on one number per row (``_run_chain(.., hidden)``) shows
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


def _run_chain(chain: list[fx.Node], x: torch.Tensor, hidden: int) -> torch.Tensor:
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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1), b.reshape(-1))
