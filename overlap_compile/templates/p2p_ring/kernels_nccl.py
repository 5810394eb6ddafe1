"""p2p_ring on NVIDIA GPUs with transport "nccl": the reference's ring, with cuBLAS pieces on the
compute stream and each step's batched NCCL send/recv on a high-priority stream, ordered by
events. Also runs transport "p2p" where the copy-engine path cannot (no peer access). Covers
slices = 1, one direction; any row stripes (``outer`` > 1 via tiling.RowStripes).

    reduce-scatter  step s = 0..W-1, d = rs_stripe(r, s):
                      compute: p_s = a[stripe d] @ b (+ bias)   (queued while step s-1 travels)
                               s > 0: wait recv_{s-1}; p_s += received  (fp32 inside the add)
                      comm:    s < W-1: send p_s to r+1, receive from r-1 (one NCCL group call)
                    the last p is my own stripe: no tail but that add (/W for avg)
    all-gather      comm: step s = 1..W-1: send what I hold (my shard, then what arrived) to r+1,
                    receive shard ag_source(r, s) from r-1; compute: my own rows first, then
                    each shard's rows once its receive is done
    all-to-all      comm: one batch per exchange s (send to r-s, receive from r+s), as soon as
                    the block is computed; my own block last, received blocks placed in order

Rounding differs from the reference's in one place: p_s is rounded to the dtype (cuBLAS output)
before the received sum is added. Capturable, no host synchronisation.
"""
from __future__ import annotations

import torch

from ...runtime import comm
from ..plans import AllGatherGemmPlan, GemmCollectivePlan
from .reference import a2a_pair, ag_source, check_config, rs_stripe


def usable(group_name: str, device: torch.device, plan=None) -> str | None:
    """Why this path cannot run the plan (None: it can); without a plan, whether it can run on
    this group and device at all."""
    from ..priority_stream.kernels import usable as nccl_on_cuda

    if getattr(plan, "kind", None) == "gemm_allreduce":
        return "the NCCL GPU path implements reduce-scatter, all-gather and all-to-all (all-reduce: the reference)"
    if plan is not None and (plan.config.get("slices", 1) != 1 or plan.config.get("bidirectional", False)):
        return "the NCCL GPU path runs slices=1 in one direction (other configs: the reference)"
    if nccl_on_cuda(group_name, device) is not None:
        return "needs CUDA tensors on an NCCL process group"
    return None


def _gemm(a, b, bias):
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _exchange(pg, send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None):
    """One NCCL group call on the current stream's side (a send and / or a receive); the
    current stream then waits for it (no host wait)."""
    import torch.distributed as dist

    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group=pg, group_peer=dst))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group=pg, group_peer=src))
    for work in dist.batch_isend_irecv(ops):
        if work is not None:
            work.wait()  # NCCL: makes the current (comm) stream wait for the transfer


def _streams(device):
    from ..priority_stream.kernels import comm_stream

    compute, side = torch.cuda.current_stream(device), comm_stream(device)
    side.wait_stream(compute)  # inputs ready; under capture this forks the comm stream in
    return compute, side


def _event(stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan) -> torch.Tensor:
    check_config(plan.kind, plan.config)
    if plan.kind == "gemm_reducescatter":
        return _reduce_scatter(a, b, bias, group_name, plan)
    if plan.kind == "gemm_alltoall":
        return _all_to_all(a, b, bias, group_name, plan)
    raise ValueError(f"p2p_ring: the NCCL GPU path implements gemm_reducescatter and gemm_alltoall, not {plan.kind!r}")


def _reduce_scatter(a, b, bias, group_name, plan: GemmCollectivePlan) -> torch.Tensor:
    if plan.reduce_op not in ("sum", "avg"):
        raise ValueError(f"p2p_ring: reduce op {plan.reduce_op!r} is not supported (supported: ['sum', 'avg'])")
    pg = comm.resolve_group(group_name)
    r, w, st = pg.rank(), plan.world, plan.stripes
    compute, side = _streams(a.device)
    arrived = None  # (buffer, event after its receive)
    held = []       # tensors the comm stream used
    for s in range(w):
        p = _gemm(st.stripe(a, rs_stripe(r, w, s)), b, bias)
        if arrived is not None:
            buf, ev = arrived
            compute.wait_event(ev)
            if s < w - 1:
                p = p.add_(buf)
            else:  # the result: the last sum in fp32, rounded once
                out = p.float().add_(buf)
                if plan.reduce_op == "avg":
                    out = out.div_(w)
                p = out.to(a.dtype)
        elif s == w - 1 and plan.reduce_op == "avg":  # W == 1
            p = p / w
        if s < w - 1:
            sent = _event(compute)
            buf = torch.empty_like(p)
            with torch.cuda.stream(side):
                side.wait_event(sent)
                _exchange(pg, p, (r + 1) % w, buf, (r - 1) % w)
                arrived = (buf, _event(side))
            held += [p, buf]
    compute.wait_stream(side)
    del held  # kept until the join (templates/base.py: no record_stream)
    return p


def _all_to_all(a, b, bias, group_name, plan: GemmCollectivePlan) -> torch.Tensor:
    pg = comm.resolve_group(group_name)
    r, w, st = pg.rank(), plan.world, plan.stripes
    compute, side = _streams(a.device)
    out = a.new_empty(plan.m, plan.n)
    landed, held = [], []
    for s in range(1, w):
        dst, src = a2a_pair(r, w, s)
        block = _gemm(st.stripe(a, dst), b, bias)
        ready = _event(compute)
        buf = torch.empty_like(block)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            _exchange(pg, block, dst, buf, src)
            landed.append((src, buf, _event(side)))
        held += [block, buf]
    st.place(out, r, _gemm(st.stripe(a, r), b, bias))  # the block that stays here, computed last
    for src, buf, ev in landed:
        compute.wait_event(ev)
        st.place(out, src, buf)
    compute.wait_stream(side)
    del held  # kept until the join (templates/base.py: no record_stream)
    return out


def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  group_name: str, plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    check_config("allgather_gemm", plan.config)
    pg = comm.resolve_group(group_name)
    r, w, st = pg.rank(), plan.world, plan.stripes
    shard = shard.contiguous()
    compute, side = _streams(shard.device)
    gathered = shard.new_empty(plan.m, plan.k)
    ys = [shard.new_empty(plan.m, n) for n in plan.ns]
    pieces, held = [], [shard]
    with torch.cuda.stream(side):  # the ring of shards, back to back on the comm stream
        cur = shard
        for s in range(1, w):
            buf = torch.empty_like(shard)
            _exchange(pg, cur, (r + 1) % w, buf, (r - 1) % w)
            pieces.append((ag_source(r, w, s), buf, _event(side)))
            held.append(buf)
            cur = buf
    for src, part, ev in [(r, shard, None)] + pieces:  # my own rows first: nothing to wait for
        if ev is not None:
            compute.wait_event(ev)
        st.place(gathered, src, part)
        for b, bias, y in zip(bs, biases, ys):
            st.place(y, src, _gemm(part, b, bias))
    compute.wait_stream(side)
    del held  # kept until the join (templates/base.py: no record_stream)
    return [gathered] + ys
