"""The backward of an expert-parallel SwiGLU section, as Inductor's post-grad graph holds it
(fp32; bf16 adds casts around the pointwise part)::

    a2a = all_to_all_single(grad_buf); w = wait_tensor(a2a)      # the combine's gradient, sent back
    g = reshape/permute/clone/reshape(w)                           # [E_local, W*C, H]
    dw2 = bmm(act_t, g)            d_act = bmm(g, permute(w2))     # act_t: saved permute(act)
    silu(gate) = gate / (exp(-gate) + 1); s = sigmoid(gate)        # recomputed from the saved gate
    d_up = d_act * silu(gate); d_gate = (d_act * up) * s * (gate * (1 - s) + 1)
    dw3 = bmm(tokens_t, d_up)      dw1 = bmm(tokens_t, d_gate)     # tokens_t: saved permute(h)
    d_h = bmm(d_up, permute(w3)) + bmm(d_gate, permute(w1))
    a2a_r = all_to_all_single(reshape/permute/clone/reshape(d_h)); wait_tensor(a2a_r)

Roles come from the structure and are proven where it could mislead: the pointwise part must be
elementwise and compute silu and its derivative (run on a probe, which also names the gate and
d_gate), and the view chains must lay tokens out as the forward does. The op reads every operand
as the bmm read them, so no layout of the saved tensors or weights is assumed.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import is_call, static_shape, val
from .matches import MoeBackwardMatch
from .moe_probes import MAX_NODES, nodes_back, run_nodes, source_layout, view_chain, wait_of

aten = torch.ops.aten
BACKWARD_BMMS = 6  # d_act, two d_h terms, three weight gradients
MAX_POINTWISE = 40  # silu and silu' as Inductor decomposes them take ~12 nodes (bf16 ~16)
PROBE_SIZE = 257


def backward_roles(m: MoeBackwardMatch, wait: fx.Node) -> str | None:
    """Fill the roles of ``m`` and return None, or say why the section stays as written."""
    generic = f"expert-parallel MoE backward section ({len(m.bmm_nodes)} bmm between two all-to-alls)"
    found = _bmm_roles(m.bmm_nodes, wait)
    if isinstance(found, str):
        return f"{generic}: {found}"
    g, d_act, dw2, data, weight = found
    region = _pointwise_region(d_act, [b.args[0] for b in data])
    if isinstance(region, str):
        return f"{generic}: {region}"
    nodes, leaves = region
    roles = _swiglu_gradient(nodes, d_act, leaves, [b.args[0] for b in data])
    if roles is None:
        return (f"{generic}: the pointwise ops between d_act = bmm(g, w2^T) and the two d_h bmm do not compute "
                f"d_up = d_act * silu(gate) and d_gate = d_act * up * silu'(gate) (checked on a probe); "
                f"moe_fused takes the SwiGLU gradient only")
    gate, up, d_gate, d_up = roles
    by_out = {b.args[0]: b for b in data}
    by_in = {b.args[1]: b for b in weight}
    d_h = next(iter(data[0].users)) if len(data[0].users) == 1 else None
    if not (is_call(d_h, aten.add.Tensor) and not d_h.kwargs and len(d_h.args) == 2 and set(d_h.args) == set(data)
            and all(set(b.users) == {d_h} for b in data)):
        return f"{generic}: the two d_h bmm are not summed by one add (d_h = d_up @ w3^T + d_gate @ w1^T)"
    inputs = {"tokens_t": weight[0].args[0], "gate": gate, "up": up, "act_t": dw2.args[0],
              "w1t": by_out[d_gate].args[1], "w3t": by_out[d_up].args[1], "w2t": d_act.args[1]}
    w, gs, fs = m.world_size, static_shape(g), static_shape(d_act)
    if gs is None or fs is None or len(gs) != 3 or w < 1 or gs[1] % w:
        return f"{generic}: the gradient of the experts' output has shape {gs}, not [E_local, W * C, H]"
    e, wc, h, f = gs[0], gs[1], gs[2], fs[2]
    want = {"buffer": (e * wc, h), "tokens_t": (e, h, wc), "gate": (e, wc, f), "up": (e, wc, f),
            "act_t": (e, f, wc), "w1t": (e, f, h), "w3t": (e, f, h), "w2t": (e, h, f)}
    operands = {"buffer": m.dispatch_node.args[0], **inputs}
    wrong = {k: static_shape(n) for k, n in operands.items() if static_shape(n) != want[k]}
    if wrong:
        return f"{generic}: operand shapes {wrong} are not the SwiGLU gradient's {({k: want[k] for k in wrong})}"
    computed = _descendants(wait, through_bmm=True)
    inner = [k for k, n in operands.items() if n in computed]
    if inner:
        return (f"{generic}: operands {inner} are computed from the gradient the section receives; "
                f"they must come from before it")
    dtypes = {k: val(n).dtype for k, n in operands.items()}
    if set(dtypes.values()) != {m.dtype}:
        return f"{generic}: operands of mixed dtypes {dtypes}; moe_fused's backward takes one dtype throughout"
    chains = source_layout(wait, g, d_h, m.combine_node.args[0], w, e, wc // w, h)
    if isinstance(chains, str):
        return f"{generic}: {chains}"
    chain_in, chain_out = chains
    combine_wait = wait_of(m.combine_node)
    if combine_wait is None:
        return f"{generic}: the second all-to-all is never waited on"
    # Everything whose value the op does not hand out must stay inside; the weight gradients and
    # the returned gradient go to their readers through the op's outputs. Pointwise nodes of the
    # gate alone (silu(gate), sigmoid(gate)) may have other readers: those keep them.
    fed = _descendants(d_act)
    dropped = [wait, *chain_in, d_act, *[n for n in nodes if n in fed], *data, d_h, *chain_out, m.combine_node]
    inside = set(dropped) | set(nodes) | {dw2, *weight, combine_wait}
    for n in dropped:
        outside = [u.name for u in n.users if u not in inside]
        if outside:
            return (f"{generic}: {n.name} is also used by {outside}: moe_fused's backward hands out only the "
                    f"returned gradient and the three weight gradients, not this")
    m.buffer_node, m.combine_wait, m.inputs, m.grad_node, m.d_h_node = operands["buffer"], combine_wait, inputs, g, d_h
    m.bmm_roles = {"d_act": d_act, "d_h_gate": by_out[d_gate], "d_h_up": by_out[d_up], "dw1": by_in[d_gate],
                   "dw3": by_in[d_up], "dw2": dw2}
    m.bmm_nodes = [m.bmm_roles[r] for r in m.BMM_ROLES]
    m.bmm_shapes = [_bmm_shape(b) for b in m.bmm_nodes]
    m.pointwise_nodes = nodes
    m.section_nodes = list(dict.fromkeys([*dropped, *nodes, dw2, *weight]))
    m.e_local, m.capacity, m.hidden, m.ffn = e, wc // w, h, f
    return None


def _bmm_roles(bmms: list[fx.Node], wait: fx.Node):
    """(g, d_act, dw2, data-gradient bmm [2], weight-gradient bmm [2], the latter in the order of
    the former's left operands) or why not: g is read as bmm(g, .) (d_act) and bmm(., g) (dw2);
    of the other four, two read d_act's descendants on the left (d_h terms), two on the right
    with one shared left operand (dW of the experts' input)."""
    reads: dict[fx.Node, list[tuple[fx.Node, int]]] = {}
    for b in bmms:
        for i in (0, 1):
            x = b.args[i]
            if isinstance(x, fx.Node) and view_chain(wait, x) is not None:
                reads.setdefault(x, []).append((b, i))
    lefts = [b for uses in reads.values() for b, i in uses if i == 0]
    rights = [b for uses in reads.values() for b, i in uses if i == 1]
    if len(reads) != 1 or len(lefts) != 1 or len(rights) != 1:
        return ("the gradient of the experts' output (the first all-to-all through views) is not one tensor g read "
                "by exactly bmm(g, w2^T) and bmm(act^T, g)")
    (g,) = reads
    d_act, dw2 = lefts[0], rights[0]
    dep = _descendants(d_act)
    data, weight = [], []
    for b in bmms:
        if b in (d_act, dw2):
            continue
        sides = [i for i in (0, 1) if b.args[i] in dep]
        if sides == [0]:
            data.append(b)
        elif sides == [1]:
            weight.append(b)
        else:
            return f"{b.name} reads d_act = bmm(g, w2^T) on {'both sides' if sides else 'neither side'}"
    outs = [b.args[0] for b in data]
    if len(data) != 2 or len(weight) != 2 or outs[0] is outs[1] or {b.args[1] for b in weight} != set(outs) \
            or weight[0].args[0] is not weight[1].args[0]:
        return ("the gradients of the two up-projections are not each read by one bmm(., w^T) (d_h) and one "
                "bmm(tokens^T, .) (dW), with the same tokens^T")
    weight.sort(key=lambda b: outs.index(b.args[1]))
    return g, d_act, dw2, data, weight


def _descendants(node: fx.Node, through_bmm: bool = False) -> set[fx.Node]:
    """What ``node`` feeds, up to the next bmm (not past it unless ``through_bmm``); bounded as
    find_moe's walk is (a section is a layer, not a model)."""
    seen, todo = set(), [node]
    while todo and len(seen) < MAX_NODES:
        n = todo.pop()
        for u in n.users:
            if u not in seen and u.op == "call_function":
                seen.add(u)
                if through_bmm or not is_call(u, aten.bmm.default):
                    todo.append(u)
    return seen


def _is_pointwise(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.pointwise in n.target.tags)


def _pointwise_region(d_act: fx.Node, outs: list[fx.Node]):
    """(the pointwise nodes computing ``outs`` from d_act and two other tensors, those three
    leaves) or why not. Elementwise for sure: pointwise ops whose every tensor has d_act's
    shape (no broadcast), so a probe on one number per element shows what they compute."""
    walked = nodes_back(outs, lambda n: n is d_act or not _is_pointwise(n), MAX_POINTWISE)
    if walked is None:
        return f"more than {MAX_POINTWISE} pointwise ops between d_act and the two d_h bmm"
    nodes, leaves = walked
    others = [n for n in leaves if n is not d_act]
    if d_act not in leaves or len(others) != 2:
        return (f"the pointwise ops between d_act and the two d_h bmm read {[n.name for n in others]} besides d_act; "
                f"the SwiGLU gradient reads two saved tensors (gate, up)")
    shape = static_shape(d_act)
    odd = [n.name for n in [*nodes, *others] if static_shape(n) != shape]
    if odd:
        return f"the pointwise ops between d_act and the two d_h bmm broadcast ({odd} are not of d_act's shape {shape})"
    return nodes, [d_act, *others]


def _swiglu_gradient(nodes: list[fx.Node], d_act: fx.Node, leaves: list[fx.Node], outs: list[fx.Node]):
    """(gate, up, d_gate, d_up) when ``nodes`` compute d_up = d_act * silu(gate) and
    d_gate = d_act * up * silu'(gate) on a probe (each leaf random, in its own dtype; the
    reference in float64 from those values), else None. Tolerance: 16 roundings of the outputs'
    dtype relative to the largest value (seen: fp32 4.7e-7 = 4 ulp, from 1 - sigmoid(gate) near
    1 times gate, which eager's silu_backward shares; bf16 0.0037, two roundings); a wrong
    formula or swapped roles is off by O(1) of it."""
    gen = torch.Generator().manual_seed(0)
    x, y = leaves[1], leaves[2]
    base = {d_act: torch.randn(PROBE_SIZE, generator=gen, dtype=torch.float64),
            x: torch.empty(PROBE_SIZE, dtype=torch.float64).uniform_(-8, 8, generator=gen),
            y: torch.empty(PROBE_SIZE, dtype=torch.float64).uniform_(-8, 8, generator=gen)}
    if any(val(n) is None or not val(n).dtype.is_floating_point for n in [*leaves, *outs]):
        return None
    env = run_nodes(nodes, {n: v.to(val(n).dtype) for n, v in base.items()})
    if env is None or any(not isinstance(env.get(o), torch.Tensor) or env[o].shape != (PROBE_SIZE,) for o in outs):
        return None
    v = {n: env[n].double() for n in [*leaves, *outs]}
    tol = 16 * max(torch.finfo(val(o).dtype).eps for o in outs)

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool(got.isfinite().all()) and (got - want).abs().max() <= tol * want.abs().max()

    for gate, up in ((x, y), (y, x)):
        s = torch.sigmoid(v[gate])
        want_up = v[d_act] * v[gate] * s
        want_gate = v[d_act] * v[up] * s * (1 + v[gate] * (1 - s))
        for dg, du in ((outs[0], outs[1]), (outs[1], outs[0])):
            if close(v[du], want_up) and close(v[dg], want_gate):
                return gate, up, dg, du
    return None


def _bmm_shape(b: fx.Node) -> tuple[int, int, int, int]:
    x, y = static_shape(b.args[0]), static_shape(b.args[1])
    return x[0], x[1], y[2], x[2]
