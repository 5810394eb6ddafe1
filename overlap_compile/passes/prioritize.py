"""Run the collectives that passes/defer_compute.py gave GEMMs to on the high-priority
communication stream, so that the collective is sure of SMs while those GEMMs run. Option
``prioritize_deferred``, off: on 2 GPUs training steps measured the same with it as without (the
collectives already ran beside those GEMMs on the process group's stream). Before (a backward,
after defer_compute)::

    rs = reduce_scatter_tensor(cat_5, 'sum', 2, '0')
    mm_9 = mm(permute_15, view_16)                  # weight gradients, moved under the collective
    w = wait_tensor(rs)
    ...readers of w...

After::

    rs = overlap_compile.prioritized_collective(cat_5, 'reduce_scatter_tensor', 'sum', 2, '0')
    mm_9 = mm(permute_15, view_16)
    overlap_compile.prioritized_join(rs)            # declared as writing rs: readers come after
    ...readers of rs...

Only collectives of CUDA tensors (and meta ones, planned: ``DEVICES``), of the kinds the op takes, whose
result is read only through its wait. The op itself runs the functional collective where its
group is not NCCL (templates/priority_stream/collective_op.py).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .defer_compute import Deferral, is_wait
from .graph_utils import val

# where it rewrites: CUDA, and meta (oc.plan's tensors, planned as a GPU compile); tests on CPU
# widen it to check the graph surgery and the op's gloo path
DEVICES: tuple[str, ...] = ("cuda", "meta")


@dataclasses.dataclass
class Prioritized:
    """One collective defer_compute gave GEMMs to: on the high-priority stream, or why not."""

    collective: str
    gemms: int
    refusal: str | None = None

    @property
    def done(self) -> bool:
        return self.refusal is None

    def describe(self) -> str:
        if self.refusal:
            return f"{self.collective}: left on the process group's stream ({self.refusal})"
        return f"{self.collective}: on the high-priority stream, beside the {self.gemms} GEMM(s) moved under it"


def prioritize_deferred(graph: fx.Graph, deferrals: list[Deferral],
                        devices: tuple[str, ...] | None = None) -> list[Prioritized]:
    """Rewrite each collective of ``deferrals`` that got a GEMM (module doc); one Prioritized per
    such collective."""
    from ..templates.priority_stream import collective_op

    devices = DEVICES if devices is None else devices
    by_name = {n.name: n for n in graph.nodes}
    out: list[Prioritized] = []
    for d in deferrals:
        start = by_name.get(d.collective)
        if start is None or d.gemms == 0:
            continue
        why = _refusal(start, devices, collective_op.KINDS)
        out.append(Prioritized(d.collective, d.gemms, why))
        if why:
            continue
        kind = start.target._opname
        args = list(start.args)
        if kind == "all_reduce":  # (inp, reduce_op, group)
            inp, reduce_op, world, group = args[0], args[1], 1, args[2]
        elif kind == "reduce_scatter_tensor":  # (inp, reduce_op, world, group)
            inp, reduce_op, world, group = args
        else:  # all_gather_into_tensor: (inp, world, group)
            inp, reduce_op, world, group = args[0], "sum", args[1], args[2]
        (wait,) = list(start.users)
        with graph.inserting_before(start):
            new = graph.call_function(torch.ops.overlap_compile.prioritized_collective.default,
                                      (inp, kind, reduce_op, world, group))
        new.meta["val"] = val(start)
        with graph.inserting_before(wait):
            graph.call_function(torch.ops.overlap_compile.prioritized_join.default, (new,))
        wait.replace_all_uses_with(new)
        graph.erase_node(wait)
        graph.erase_node(start)
    if any(p.done for p in out):
        graph.lint()
    return out


def _refusal(start: fx.Node, devices: tuple[str, ...], kinds: tuple[str, ...]) -> str | None:
    kind = start.target._opname
    if kind not in kinds:
        return f"{kind} is not taken; allowed: {', '.join(kinds)}"
    if start.kwargs or len(start.args) != (3 if kind != "reduce_scatter_tensor" else 4):
        return "its arguments are not the functional op's positional ones"
    users = list(start.users)
    if len(users) != 1 or not is_wait(users[0]):
        return "its result is read other than through one wait"
    t = val(start)
    if not isinstance(t, torch.Tensor) or t.device.type not in devices:
        return f"tensors on {getattr(t, 'device', '?')} (only {', '.join(devices)})"
    return None
