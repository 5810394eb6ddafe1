"""Find expert-parallel MoE sections: all_to_all -> expert GEMMs -> all_to_all.

Forward graphs of a layer such as overlap_compile.demo.moe hold (backward graphs the mirror)::

    a2a_d = all_to_all_single(dispatch_buffer) ; w_d = wait_tensor(a2a_d)
    h = view/permute(w_d) ; y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2)
    a2a_c = all_to_all_single(view/permute(y)) ; wait_tensor(a2a_c)

The finder walks forward from a waited all_to_all through anything but a collective and reports a
section at a second all_to_all of the same group with at least two bmm on the way. A section of 6
bmm is the backward form (find_moe_backward.py proves or refuses its roles).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .find_moe_backward import BACKWARD_BMMS, backward_roles
from .graph_utils import is_call, static_shape, val
from ..templates.plans import MOE_SAVE_ROLES as SAVE_ROLES  # the intermediates moe_fused can return
from .matches import MoeBackwardMatch, MoeSectionMatch
from .moe_probes import MAX_NODES, nodes_back, run_nodes, source_layout, wait_of as _wait_of

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


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
    # the backward section's bmm: the data gradients d_act, d_h (two) and the weight gradients
    cls = MoeBackwardMatch if len(bmms) == BACKWARD_BMMS else MoeSectionMatch
    m = cls(
        group_name=group, world_size=world, dtype=dtype, graph=graph_name, unsupported=None,
        dispatch_node=a2a, combine_node=combine, bmm_nodes=bmms, bmm_shapes=shapes, dispatch_bytes=nbytes)
    m.dispatch_wait = wait
    roles = backward_roles if cls is MoeBackwardMatch else _swiglu_roles
    m.unsupported = _uneven_splits(m) or roles(m, wait)
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


def _swiglu_roles(m: MoeSectionMatch, wait: fx.Node) -> str | None:
    """Fill the SwiGLU roles of ``m`` (demo.moe's form) and return None, or say why not:
    h = layout(wait_d); y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2); combine(layout^-1(y)), where
    layout is [W * E_local * C, H] -> [W, E_local, C, H] -> [E_local, W * C, H] (checked by running
    the view chains on a probe tensor), nothing in between used outside the section."""
    generic = (f"expert-parallel MoE section ({len(m.bmm_nodes)} expert bmm between two all-to-alls)")
    if len(m.bmm_nodes) != 3:
        return (f"{generic}: moe_fused takes the SwiGLU form (3 bmm) or its gradient ({BACKWARD_BMMS} bmm); "
                f"this one is neither")
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
    chains = source_layout(wait, h, b2, combine_in, w, e_local, cap, hidden)
    if isinstance(chains, str):
        return f"{generic}: {chains}"
    chain_in, chain_out = chains
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
    walked = nodes_back([other[0]], lambda n: n is b1, limit=16)  # back from the operand to b1
    if walked is None or walked[1] != [b1]:
        return None
    nodes = walked[0]
    # the probe in the section's dtype: with bf16 / fp16 Inductor's decomposition casts to fp32
    # and back, so the result is silu rounded to that dtype
    dtype = val(b1).dtype if val(b1) is not None else torch.float32
    probe = torch.linspace(-6, 6, 97).to(dtype)
    env = run_nodes(nodes, {b1: probe})
    if env is None:
        return None
    got = env.get(other[0]) if other[0] is not b1 else probe
    want = torch.nn.functional.silu(probe.float())
    rtol = 2 * torch.finfo(dtype).eps  # two roundings at most (the cast back, the division)
    if got is None or not torch.allclose(got.float(), want, rtol=rtol, atol=1e-6):
        return None
    return nodes
