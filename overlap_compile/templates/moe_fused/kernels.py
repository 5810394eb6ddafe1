"""moe_fused on NVIDIA GPUs with transport "p2p": the source-piece pipeline of reference.py with
the pieces moved by the copy engine between symmetric buffers (no SMs taken from the expert
GEMMs, the reason p2p_ring's copy-engine all-to-all beat NCCL's by 1.32-1.39x on 2x H200), the
experts on cuBLAS bmm, readiness through runtime.peer_flags (stream memory operations, bounded
one-thread waits). Config ``{"split": "source", "transport": "p2p"}``.

STATUS: written 2026-11-23 while no multi-GPU machine was lent; not yet run on GPUs, so
spec.gpu_implemented stays False (tests/gpu/test_moe.py covers it with the NCCL path).

Rank r, world W, rows = E_local * C per slot; buf = [W, rows, H] (slot d: tokens for rank d's
experts). Sources in round order src_k = (r - k) % W, k = 1..W-1 (reference.round_peers)::

    compute (call start, before any GEMM holds the SMs)
                  wait DISPATCH.BUSY[q] == 0 for every peer q (q done pulling my last slots)
                  send[q] <- buf[q] (staged into my symmetric buffer); BUSY[q] = 1; READY[me] = 1 on q
                  wait DISPATCH.READY[src] for every src
    copy stream   wait COMBINE.BUSY[src] == 0 for every src (src done reading my last results)
                  for k: recv_k <- peer(src_k).send[r] (copy engine); DISPATCH.BUSY[me] = 0 on src_k;
                         event pulled_k
    compute       experts(own half 0) -> out[r]
                  for k: wait pulled_k; y_k = experts(recv_k); event done_k
                     copy stream: wait done_k; COMBINE.BUSY[src_k] = 1;
                                  peer(src_k).comb[r] <- y_k (copy engine); COMBINE.READY[me] = 1 on src_k
                  experts(own half 1) -> out[r]
                  for k: wait COMBINE.READY[src_k]; out[src_k] <- comb[src_k]; COMBINE.BUSY[me] = 0 on src_k

Every cross-rank wait runs on the compute stream between GEMMs or before the first one, never
on the copy stream while a GEMM holds every SM (a wait kernel needs an SM slot). Buffers are
allocated once per (group, shape, dtype); the op is stream work only (capturable).
"""
from __future__ import annotations

import torch

from ...runtime import comm, peer_flags, spin_wait, symm
from ..plans import MoePlan
from . import reference as ref

TEMPLATE = "moe_fused"


def usable(group_name: str, device: torch.device, plan: MoePlan) -> str | None:
    """Why the copy-engine path cannot run this plan here (None: it can)."""
    if plan.config.get("transport") != "p2p":
        return "the plan's transport is not 'p2p'"
    if not ref.by_source(plan.config):
        return "the copy-engine path cuts the section by source rank only ({'split': 'source'})"
    if not spin_wait.HAVE_TRITON:
        return "the bounded waits need Triton"
    return symm.usable(group_name, device)


def check_errors(device: torch.device | int | None = None, synchronize: bool = True) -> None:
    """Raise peer_flags.PeerWaitTimeoutError if a bounded flag wait failed on ``device``."""
    peer_flags.check_errors(device, synchronize)


def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan) -> torch.Tensor:
    """The combined slots ``[W * rows, H]`` (what reference.run returns)."""
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    rows, dev, dt = e * c, buf.device, buf.dtype
    check_errors(dev, synchronize=False)
    if comm.rank_and_size(group_name)[1] != w:
        raise ValueError(f"{TEMPLATE}: group {group_name!r} does not have the plan's {w} ranks")
    shape = (w, rows, h)
    send = symm.symm_buffer(group_name, f"{TEMPLATE}/send", shape, dt, dev)
    comb = symm.symm_buffer(group_name, f"{TEMPLATE}/combine", shape, dt, dev)
    tag = f"{w}x{rows}x{h}/{dt}"
    fd = peer_flags.PeerFlags(TEMPLATE, group_name, f"dispatch/{tag}", w, dev, plan.timeout_ms, "moe dispatch")
    fc = peer_flags.PeerFlags(TEMPLATE, group_name, f"combine/{tag}", w, dev, plan.timeout_ms, "moe combine")
    r = send.rank
    slots = buf.view(shape)
    srcs = [ref.round_peers(r, w, k)[1] for k in range(1, w)]
    compute, copier = torch.cuda.current_stream(dev), peer_flags.copy_stream(dev)

    def stage():  # the peers' slots into my symmetric buffer, where they pull them from
        for q in srcs:
            send.local[q].copy_(slots[q])

    fd.publish_and_meet(srcs, stage)  # before any GEMM of this call holds the SMs
    copier.wait_stream(compute)
    recv = [buf.new_empty(rows, h) for _ in srcs]
    pulled = []
    with torch.cuda.stream(copier):
        for src in srcs:
            fc.wait_free(src)  # my results of src's previous call were read out there
        for src, into in zip(srcs, recv):
            into.copy_(send.peer(src)[r])
            fd.release(src)
            pulled.append(_event(copier))

    out = buf.new_empty(shape)
    own, own_out = slots[r].view(e, c, h), out[r].view(e, c, h)
    first, *rest = ref.own_parts(e, c)
    ref.own_experts(own, w1, w3, w2, own_out, first)
    ys = []
    for src, into, ev in zip(srcs, recv, pulled):
        compute.wait_event(ev)
        y = ref.experts(into.view(e, c, h), w1, w3, w2)
        done = _event(compute)
        with torch.cuda.stream(copier):
            copier.wait_event(done)
            fc.busy(src)
            comb.peer(src)[r].copy_(y.view(rows, h))
            fc.ready(src)
        ys.append(y)
    for part in rest:
        ref.own_experts(own, w1, w3, w2, own_out, part)
    for k, src in enumerate(srcs, start=1):
        fc.wait_ready(src, k)
        out[src].copy_(comb.local[src])
        fc.release(src)
    compute.wait_stream(copier)
    for t in (buf, *recv, *ys):
        t.record_stream(copier)
    return out.view(w * rows, h)
