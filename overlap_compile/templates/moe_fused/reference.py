"""moe_fused, step by step on any device: the expert-parallel section as a pipeline of pieces.

The section as written (demo.moe)::

    got = all_to_all(buf)                        # [W, E_local, C, H]: every source's slots
    y   = swiglu_experts(got as [E_local, W*C, H])
    out = all_to_all(y as [W, E_local, C, H])    # back to the sources

Every slot (token position) is independent through the experts, so the capacity axis C is cut
into ``pieces``; each piece's dispatch all-to-all is started at once, its experts run as soon as
it has landed, and its combine all-to-all starts right after (FlashDMoE's "expert tiles start as
tokens arrive, combine tiles leave as they finish", at piece granularity)::

    dispatch p0 | dispatch p1 | dispatch p2 ...
                  experts p0  | experts p1 ...
                                combine p0  | combine p1 ...

The collectives are the asynchronous functional ones on the site's group (NCCL on GPUs: they run
on NCCL's stream while the compute stream does the experts of the previous piece; gloo here).
Padding slots travel as they do in the original (payload-efficient dispatch is not built).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import comm
from ..plans import MoePlan


def bounds(size: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, size))
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


def experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan) -> torch.Tensor:
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    slots = buf.view(w, e, c, h)
    pieces = bounds(c, plan.config.get("pieces", 1))
    sent = [comm.start_all_to_all(slots[:, :, lo:hi].reshape(-1, h), w, group_name) for lo, hi in pieces]
    back = []
    for (lo, hi), t in zip(pieces, sent):
        n = hi - lo
        got = comm.wait(t).view(w, e, n, h).transpose(0, 1).reshape(e, w * n, h)
        y = experts(got, w1, w3, w2).view(e, w, n, h).transpose(0, 1).reshape(-1, h)
        back.append(comm.start_all_to_all(y, w, group_name))
    out = buf.new_empty(w, e, c, h)
    for (lo, hi), t in zip(pieces, back):
        out[:, :, lo:hi] = comm.wait(t).view(w, e, hi - lo, h)
    return out.view(w * e * c, h)
