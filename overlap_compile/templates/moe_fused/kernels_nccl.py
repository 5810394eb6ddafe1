"""moe_fused on NVIDIA GPUs over NCCL (transport "nccl", the default): reference.py's piece
pipeline with the pieces' all-to-alls on a high-priority communication stream, so they get SMs as
soon as issued rather than behind the expert bmm, ordered by events (capturable).

    comm stream     dispatch piece 1 .. P-1 back to back (an event after each), then combine r
                    once the compute stream's event "experts r done" has fired
    compute stream  experts of piece 0 (by source: the rank's own tokens, no transfer), then
                    experts of piece r after its dispatch event
    join            the compute stream waits for the comm stream before the op returns

Every rank issues the same collectives in round order. Slower than the layer as written on GPUs,
so GPU profiles do not offer it (spec.py: force_config only).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..plans import MoePlan
from ..priority_stream.kernels import comm_stream, usable  # noqa: F401  (same stream, same test)
from . import reference as ref


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan) -> torch.Tensor:
    from ...runtime.comm import resolve_group

    pg = resolve_group(group_name)
    if pg.size() != plan.world:
        raise ValueError(f"moe_fused: group {group_name!r} has {pg.size()} ranks, the plan was made for {plan.world}")
    compute = torch.cuda.current_stream(buf.device)
    side = comm_stream(buf.device)
    if ref.by_source(plan.config):
        return _by_source(buf, w1, w3, w2, pg, plan, compute, side)
    return _by_capacity(buf, w1, w3, w2, pg, plan, compute, side)


def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _by_source(buf, w1, w3, w2, pg, plan: MoePlan, compute, side) -> torch.Tensor:
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    rank, rows = pg.rank(), plan.e_local * plan.capacity
    slots, out = buf.view(w, rows, h), buf.new_empty(w, rows, h)
    saved = ref.Saved(plan, buf)
    packed = ref.packed_experts(plan.config)

    def own() -> None:  # no transfer, computed while round 1 travels, straight into the output
        ref.experts(slots[rank].view(e, c, h), w1, w3, w2, out=out[rank].view(e, c, h), keep=saved.of_source(rank),
                    packed=packed)

    def peer(src: int, got: torch.Tensor) -> torch.Tensor:
        return ref.experts(got.view(e, c, h), w1, w3, w2, keep=saved.of_source(src), packed=packed).view(rows, h)

    rounds_by_source(slots, out, pg, compute, side, own, peer)
    return saved.result(out.view(w * rows, h))


def rounds_by_source(slots: torch.Tensor, out: torch.Tensor, pg, compute: torch.cuda.Stream, side: torch.cuda.Stream,
                     own: Callable[[], None], peer: Callable[[int, torch.Tensor], torch.Tensor],
                     after: Callable[[], None] | None = None) -> None:
    """reference.exchange_by_source on CUDA streams, both directions of a training step:
    ``slots`` [W, rows, H] go to rank j by block, ``out`` [W, rows, H] is filled from rank j by
    block. The comm stream starts every piece (an event after each); the compute stream runs
    ``own()`` (the own block, no transfer: it writes ``out[rank]`` itself), then, per round once
    that piece's event fired, ``peer(src, received [rows, H])``, whose result the comm stream
    sends home after the compute stream's event; then ``after()`` (beside the last transfers).
    The compute stream joins the comm stream before this returns."""
    import torch.distributed as dist

    w, rows, h = slots.shape
    rank = pg.rank()
    recv = [slots.new_empty(rows, h) for _ in range(w - 1)]
    side.wait_stream(compute)  # the slots are written before the first piece reads them
    landed = []
    with torch.cuda.stream(side):
        for r in range(1, w):
            dst, src = ref.round_peers(rank, w, r)
            dist.all_to_all_single(recv[r - 1], slots[dst], ref.one_peer_splits(w, src, rows),
                                   ref.one_peer_splits(w, dst, rows), group=pg)
            landed.append(_event(side))
    own()
    results = []
    for r in range(1, w):
        dst, src = ref.round_peers(rank, w, r)
        compute.wait_event(landed[r - 1])
        results.append(peer(src, recv[r - 1]))
        done = _event(compute)
        with torch.cuda.stream(side):
            side.wait_event(done)
            # the output splits put the piece at row 0 of out[dst]: straight into place
            dist.all_to_all_single(out[dst], results[-1], ref.one_peer_splits(w, dst, rows),
                                   ref.one_peer_splits(w, src, rows), group=pg)
    if after is not None:
        after()
    compute.wait_stream(side)  # join: the result is ready in the caller's stream order


def _by_capacity(buf, w1, w3, w2, pg, plan: MoePlan, compute, side) -> torch.Tensor:
    import torch.distributed as dist

    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    slots = buf.view(w, e, c, h)
    pieces = ref.bounds(c, plan.config.get("pieces", 1))
    out = buf.new_empty(w, e, c, h)
    # the pieces are strided slices of the capacity axis: packed on the compute stream (before the
    # fork), received into scratch, placed on the comm stream after their combine
    sends = [slots[:, :, lo:hi].reshape(-1, h) for lo, hi in pieces]
    recvs = [torch.empty_like(s) for s in sends]
    ys = [torch.empty_like(s) for s in sends]
    backs = [torch.empty_like(s) for s in sends]
    side.wait_stream(compute)
    landed = []
    with torch.cuda.stream(side):
        for s, r in zip(sends, recvs):
            dist.all_to_all_single(r, s, group=pg)
            landed.append(_event(side))
    saved = ref.Saved(plan, buf)
    for (lo, hi), ev, r, y, back in zip(pieces, landed, recvs, ys, backs):
        n = hi - lo
        compute.wait_event(ev)
        got = r.view(w, e, n, h).transpose(0, 1).reshape(e, w * n, h)
        y.view(w, e, n, h).copy_(ref.experts(got, w1, w3, w2, keep=saved.of_capacity(lo, hi)).view(e, w, n, h)
                                 .transpose(0, 1))
        done = _event(compute)
        with torch.cuda.stream(side):
            side.wait_event(done)
            dist.all_to_all_single(back, y, group=pg)
            out[:, :, lo:hi] = back.view(w, e, n, h)
    compute.wait_stream(side)  # join (templates/base.py: what the side stream used is held until here)
    return saved.result(out.view(w * e * c, h))

