"""p2p_ring on NVIDIA GPUs with transport "p2p": peer copies over symmetric memory (copy engine,
no SMs taken from the GEMM), cuBLAS for the GEMM pieces.

STATUS: written after the 2x/4x H200 profile runs measured the copy engine at ~380 GB/s per peer
copy (benchmarks/results/profiles/); not yet run on a GPU. spec.py keeps ``gpu_implemented =
False`` (the predictor does not offer p2p_ring under GPU profiles) until tests/gpu/test_p2p_ring.py
passes on the device.

All-gather -> GEMMs (pull; shards along rows, ``outer == 1``)::

    compute stream  copy my shard into my symmetric buffer; barrier(0)    (every shard in place)
    copy stream     for s = 1..W-1: gathered[rows of r+s] <- peer(r+s)    (copy engine), event_s
    compute stream  y_i[rows of r] = shard @ b_i; then for s = 1..W-1: wait event_s,
                    y_i[rows of r+s] = gathered[rows of r+s] @ b_i
                    join the copy stream; barrier(1)       (nobody still reads my buffer when
                                                            the next call overwrites it)

GEMM -> reduce-scatter (push; stripes along rows, ``outer == 1``): my symmetric buffer has one
slot per source rank::

    compute stream  for s = 1..W-1: d = r - s: partial_d = a[stripe d] @ b (+ bias), event_s
    copy stream     wait event_s; peer(d)[slot r] <- partial_d             (copy engine)
    compute stream  my own partial straight into slot r (computed last: no tail)
                    join the copy stream; barrier(0)      (every partial has landed everywhere)
                    out = sum over slots (fp32), / W for "avg"; barrier(1)  (slots free again)

The barriers are symmetric memory's device-side barrier with the plan's timeout (bounded). The
whole op is stream work (copies, events, cuBLAS, barrier kernels): capturable in a CUDA graph.
The math is the reference's (reference.py), in another order of summation for reduce-scatter.
"""
from __future__ import annotations

import torch

from ...runtime import symm
from ..plans import AllGatherGemmPlan, GemmCollectivePlan


def usable(group_name: str, device: torch.device, plan) -> str | None:
    """Why the copy-engine path cannot run this plan here (None: it can)."""
    if plan.config.get("transport") != "p2p":
        return "the plan's transport is not 'p2p'"
    if plan.outer != 1:
        return "the copy-engine path moves whole row stripes (scatter / gather along dim 0 only)"
    return symm.usable(group_name, device)


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    from ..priority_stream.kernels import comm_stream

    return comm_stream(device)


def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  group_name: str, plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    w, rows = plan.world, plan.chunk
    shard = shard.contiguous()
    buf = symm.symm_buffer(group_name, "p2p_ring.allgather", (rows, plan.k), shard.dtype, shard.device)
    r = buf.rank
    compute, copier = torch.cuda.current_stream(shard.device), _copy_stream(shard.device)
    gathered = shard.new_empty(plan.m, plan.k)
    outs = [gathered] + [shard.new_empty(plan.m, n) for n in plan.ns]
    buf.local.copy_(shard)
    gathered[r * rows:(r + 1) * rows].copy_(shard)
    buf.barrier(0, plan.timeout_ms)
    copier.wait_stream(compute)
    events = []
    with torch.cuda.stream(copier):
        for s in range(1, w):
            src = (r + s) % w
            gathered[src * rows:(src + 1) * rows].copy_(buf.peer(src))
            ev = torch.cuda.Event()
            ev.record(copier)
            events.append((src, ev))
    _gemms(gathered, r, rows, bs, biases, outs)
    for src, ev in events:
        compute.wait_event(ev)
        _gemms(gathered, src, rows, bs, biases, outs)
    compute.wait_stream(copier)
    gathered.record_stream(copier)
    buf.barrier(1, plan.timeout_ms)
    return outs


def _gemms(gathered, src, rows, bs, biases, outs) -> None:
    part = gathered[src * rows:(src + 1) * rows]
    for b, bias, y in zip(bs, biases, outs[1:]):
        dst = y[src * rows:(src + 1) * rows]
        if bias is None:
            torch.mm(part, b, out=dst)
        else:
            torch.addmm(bias, part, b, out=dst)


def run_reducescatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                      plan: GemmCollectivePlan) -> torch.Tensor:
    w, rows = plan.world, plan.chunk
    buf = symm.symm_buffer(group_name, "p2p_ring.reducescatter", (w, rows, plan.n), a.dtype, a.device)
    r = buf.rank
    compute, copier = torch.cuda.current_stream(a.device), _copy_stream(a.device)

    def partial(d: int, out: torch.Tensor | None = None) -> torch.Tensor:
        part = a[d * rows:(d + 1) * rows]
        if bias is None:
            return torch.mm(part, b, out=out) if out is not None else torch.mm(part, b)
        return torch.addmm(bias, part, b, out=out) if out is not None else torch.addmm(bias, part, b)

    for s in range(1, w):  # farthest ring distance first, my own stripe last
        d = (r - s) % w
        p = partial(d)
        ev = torch.cuda.Event()
        ev.record(compute)
        copier.wait_event(ev)
        with torch.cuda.stream(copier):
            buf.peer(d)[r].copy_(p)
        p.record_stream(copier)
    partial(r, out=buf.local[r])
    compute.wait_stream(copier)
    buf.barrier(0, plan.timeout_ms)
    out = buf.local.float().sum(0)
    if plan.reduce_op == "avg":
        out = out / w
    out = out.to(a.dtype)
    buf.barrier(1, plan.timeout_ms)
    return out
