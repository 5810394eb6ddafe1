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
    return MoeSectionMatch(
        group_name=group, world_size=world, dtype=dtype, graph=graph_name,
        unsupported=(f"expert-parallel MoE section ({len(bmms)} expert bmm between two all-to-alls): no template "
                     "takes MoE sections yet (moe_fused, issue #7); both all-to-alls run as they are"),
        dispatch_node=a2a, combine_node=combine, bmm_nodes=bmms, bmm_shapes=shapes, dispatch_bytes=nbytes)
