"""moe_fused on NVIDIA GPUs with transport "p2p": reference.py's source-piece pipeline with the
pieces moved by the copy engine between symmetric buffers (no SMs taken from the expert GEMMs),
readiness through runtime.peer_flags. Config ``{"split": "source", "transport": "p2p"}``; experts
on cuBLAS bmm, or ``"experts": "fused"`` (expert_kernel.py), whose ``"skip_padding"`` skips tiles
past each source's routed rows (sizes sent with the slots, routed_sizes.py).

Rank r, world W, buf = [W, E_local * C, H]; sources in round order src_k = (r - k) % W::

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

Cross-rank waits run on the compute stream between GEMMs, never on the copy stream while a GEMM
holds every SM (a wait kernel needs an SM slot). Stream work only: capturable.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ...runtime import comm, peer_flags, spin_wait, symm
from ..plans import MoePlan
from . import reference as ref
from . import routed_sizes

TEMPLATE = "moe_fused"


def usable(group_name: str, device: torch.device, plan: MoePlan | None = None) -> str | None:
    """Why the copy-engine path cannot run this plan here (None: it can); without a plan, whether
    it can run on this group and device at all."""
    if plan is not None and plan.config.get("transport") != "p2p":
        return "the plan's transport is not 'p2p'"
    if plan is not None and not ref.by_source(plan.config):
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


@dataclasses.dataclass
class _Call:
    """What both expert strategies share: geometry, buffers, flags, streams."""

    w: int
    e: int
    c: int
    h: int
    r: int
    slots: torch.Tensor  # [W, rows, H] view of the dispatch buffer
    send: symm.SymmBuffer
    comb: symm.SymmBuffer
    fd: peer_flags.PeerFlags
    fc: peer_flags.PeerFlags
    srcs: list[int]
    compute: torch.cuda.Stream
    copier: torch.cuda.Stream
    sizes: symm.SymmBuffer | None = None  # [W, E] int32: my routed rows per (destination, expert)

    @property
    def rows(self) -> int:
        return self.e * self.c


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan, outs: list[torch.Tensor] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """The combined slots ``[W * rows, H]`` (what reference.run returns). ``outs``: the op's
    outputs to write into (the combined slots, then ``plan.saves``), bmm experts only: stream
    work into buffers the caller owns is what runtime.op_graphs replays (op.py)."""
    if outs is not None and plan.config.get("experts", "bmm") == "fused":
        raise ValueError(f"{TEMPLATE}: the persistent expert kernel path allocates its outputs (no outs=)")
    call = open_call(buf, group_name, plan)
    saved = ref.Saved(plan, buf, None if outs is None else outs[1:])
    if plan.config.get("experts", "bmm") == "fused":
        out, used = _fused_experts(call, w1, w3, w2, plan, saved)
    else:
        out, used = _bmm_experts(call, w1, w3, w2, saved, None if outs is None else outs[0],
                                 ref.packed_experts(plan.config))
    finish_call(call, out, [buf, *used])
    return saved.result(out.view(-1, call.h))


def open_call(buf: torch.Tensor, group_name: str, plan: MoePlan) -> _Call:
    """A call's start, either direction (``buf``: the dispatch slots, or backward's gradient
    slots): the buffers and flags of this geometry, the peers' slots staged into my symmetric
    buffer and the handshake (before any GEMM of the call holds the SMs), and, on the copy
    stream, the wait until every peer has read out my results of the last call."""
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    rows, dev, dt = e * c, buf.device, buf.dtype
    check_errors(dev, synchronize=False)
    _check_expert_kernels()
    if comm.rank_and_size(group_name)[1] != w:
        raise ValueError(f"{TEMPLATE}: group {group_name!r} does not have the plan's {w} ranks")
    shape = (w, rows, h)
    send = symm.symm_buffer(group_name, f"{TEMPLATE}/send", shape, dt, dev)
    comb = symm.symm_buffer(group_name, f"{TEMPLATE}/combine", shape, dt, dev)
    tag = f"{w}x{rows}x{h}/{dt}"
    r = send.rank
    call = _Call(w, e, c, h, r, buf.view(shape), send, comb,
                 peer_flags.flags(TEMPLATE, group_name, f"dispatch/{tag}", w, dev, plan.timeout_ms, "moe dispatch"),
                 peer_flags.flags(TEMPLATE, group_name, f"combine/{tag}", w, dev, plan.timeout_ms, "moe combine"),
                 [ref.round_peers(r, w, k)[1] for k in range(1, w)],
                 torch.cuda.current_stream(dev), peer_flags.copy_stream(dev))
    if plan.config.get("skip_padding"):
        call.sizes = symm.symm_buffer(group_name, f"{TEMPLATE}/sizes", (w, e), torch.int32, dev)

    def stage():  # the peers' slots into my symmetric buffer, where they pull them from
        for q in call.srcs:
            send.local[q].copy_(call.slots[q])
        if call.sizes is not None:  # published with the slots: read before the pull releases them
            call.sizes.local.copy_(routed_sizes.sizes(call.slots.view(w, e, c, h)))

    call.fd.publish_and_meet(call.srcs, stage)
    call.copier.wait_stream(call.compute)
    with torch.cuda.stream(call.copier):
        for src in call.srcs:
            call.fc.wait_free(src)  # my results of src's previous call were read out there
    return call


def finish_call(call: _Call, out: torch.Tensor, used: list[torch.Tensor]) -> None:
    """The results of my slots, back from every peer, into ``out`` [W, rows, H]; then the compute
    stream joins the copy stream. ``used``: what the copy stream read, held until that join
    (templates/base.py: no record_stream)."""
    for k, src in enumerate(call.srcs, start=1):
        call.fc.wait_ready(src, k)
        out[src].copy_(call.comb.local[src])
        call.fc.release(src)
    call.compute.wait_stream(call.copier)


def _push_result(call: _Call, src: int, y: torch.Tensor) -> None:
    """On the copy stream: my experts' result for ``src``'s tokens into slot ``me`` of its combine
    buffer, then READY there."""
    call.fc.busy(src)
    call.comb.peer(src)[call.r].copy_(y.reshape(call.rows, call.h))
    call.fc.ready(src)


def _bmm_experts(call: _Call, w1, w3, w2, saved: ref.Saved, into: torch.Tensor | None = None,
                 packed: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """cuBLAS bmm per piece (rounds below); the own tokens in two halves around the peer pieces
    (reference.own_parts). The combined slots go into ``into`` ``[W * rows, H]`` when given.
    ``packed``: grouped GEMMs on each piece's routed rows instead (packed.py)."""
    e, c, h, r = call.e, call.c, call.h, call.r
    out = torch.empty_like(call.slots) if into is None else into.view(call.slots.shape)
    own, own_out = call.slots[r].view(e, c, h), out[r].view(e, c, h)
    first, *rest = ref.own_parts(e, c)

    def peer(src: int, got: torch.Tensor) -> torch.Tensor:
        return ref.experts(got.view(e, c, h), w1, w3, w2, keep=saved.of_source(src), packed=packed)

    def last() -> None:
        for part in rest:
            ref.own_experts(own, w1, w3, w2, own_out, part, saved, r, packed)

    used = rounds(call, lambda: ref.own_experts(own, w1, w3, w2, own_out, first, saved, r, packed), peer, last)
    return out, used


def rounds(call: _Call, own_first: Callable[[], None], peer: Callable[[int, torch.Tensor], torch.Tensor],
           last: Callable[[], None]) -> list[torch.Tensor]:
    """The pieces by source over the copy engine, either direction: each peer piece pulled whole
    (one copy, one event), ``peer(src, piece)`` once it has landed, its result pushed home when
    done; ``own_first()`` before the first peer piece, ``last()`` after the last (work that hides
    the last push). Returns the tensors the copy stream still reads."""
    r = call.r
    recv = [call.slots.new_empty(call.rows, call.h) for _ in call.srcs]
    pulled = []
    with torch.cuda.stream(call.copier):
        for src, into in zip(call.srcs, recv):
            into.copy_(call.send.peer(src)[r])
            call.fd.release(src)
            pulled.append(_event(call.copier))
    own_first()
    ys = []
    for src, into, ev in zip(call.srcs, recv, pulled):
        call.compute.wait_event(ev)
        y = peer(src, into)
        done = _event(call.compute)
        with torch.cuda.stream(call.copier):
            call.copier.wait_event(done)
            _push_result(call, src, y)
        ys.append(y)
    last()
    return recv + ys


def _fused_experts(call: _Call, w1, w3, w2, plan: MoePlan, saved: ref.Saved) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One persistent kernel (expert_kernel.py) over every source's tokens: the copy stream pulls
    each (source, expert) chunk and sets its arrival flag, the kernel's tiles start as their chunk
    lands; once a source's output tiles are all counted (a bounded wait on the copy stream,
    consuming the count) its result goes home. The kernel leaves two SMs free for those waits.
    A training section's intermediates are written in place: the tokens land in the saved
    tokens' layout, and the kernel stores act, gate and up into theirs (no copies after)."""
    from . import expert_kernel as EK

    e, c, h, r, w = call.e, call.c, call.h, call.r, call.w
    dev = call.slots.device
    cfg = EK.ExpertTiles(**plan.config.get("tiles", {}))
    counters = _counters(w, e, c, cfg.block_m, dev)

    def by_source(role: str, width: int) -> torch.Tensor:  # [W, E, C, width], the saved tensor when kept
        kept = saved.tensors.get(role)
        if kept is None:
            return call.slots.new_empty(w, e, c, width)
        return kept.view(e, w, c, width).permute(1, 0, 2, 3)

    x = by_source("tokens", h)
    y = call.slots.new_empty(w, e, c, h)
    act = by_source("act", w1.shape[2])
    keep = {role: by_source(role, w1.shape[2]) for role in ("gate", "up") if role in saved.tensors}
    flags = counters.arrival
    # the routed rows of every (source, expert), each source's landing before its arrival flags
    sizes = None if call.sizes is None else torch.empty(w, e, dtype=torch.int32, device=dev)
    with torch.cuda.stream(call.copier):
        x[r].copy_(call.slots[r].view(e, c, h))  # a local copy: the kernel reads one tensor
        if sizes is not None:
            sizes[r].copy_(call.sizes.local[r])
        for j in range(e):
            symm.write_value32(flags, r * e + j, 1)
        for src in call.srcs:
            piece = call.send.peer(src)[r].view(e, c, h)
            if sizes is not None:
                sizes[src].copy_(call.sizes.peer(src)[r])
            for j in range(e):
                x[src, j].copy_(piece[j])
                symm.write_value32(flags, src * e + j, 1)
            call.fd.release(src)
    order = EK.tile_order(w, r, e, c, w1.shape[2], h, cfg.block_m, cfg.block_f, cfg.block_h, cfg.group_m)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def launch() -> None:
        EK.launch(x, w1, w3, w2, act, y, EK.tile_table(order, dev), flags.view(torch.int32), counters.act_done,
                  counters.y_done, counters.err, min(sms - 2, len(order)), cfg, True, plan.timeout_ms,
                  sizes=None if sizes is None else sizes.view(-1), ticket=counters.ticket,
                  gate=keep.get("gate"), up=keep.get("up"), whole_act="act" in saved.tensors)

    try:
        launch()
    except Exception as ex:  # a Triton that refuses a pinned host pointer: the record in device memory
        if not (counters.err.is_pinned() and "ointer" in str(ex)):
            raise
        counters.err = torch.zeros_like(counters.err, device=dev)
        launch()
    per_source = e * -(-c // cfg.block_m) * -(-h // cfg.block_h)
    with torch.cuda.stream(call.copier):
        for k, src in enumerate(call.srcs, start=1):
            t = peer_flags.tag(f"{TEMPLATE}: fused experts, source {src}: wait for its {per_source} output tiles")
            spin_wait.wait_value(counters.y_done, src, per_source, plan.timeout_ms, t, until_equal=False,
                                 sys_scope=False)
            _push_result(call, src, y[src])
    # my own tokens' result: after the kernel, in stream order (nothing to wait for)
    out = torch.empty_like(call.slots)
    out[r].copy_(y[r].view(call.rows, h))
    used = [x, y, act] + ([sizes] if sizes is not None else [])
    # arrival flags, row counters and the ticket back to zero for the next call, after the kernel
    # (the copy stream's waits consumed y_done[src] for every peer; mine is reset here)
    counters.reset(y_done=False)
    counters.y_done[r:r + 1].zero_()
    return out, used


_counter_cache: dict[tuple, "object"] = {}


def _counters(w: int, e: int, c: int, block_m: int, dev: torch.device):
    """The expert kernel's signals for this geometry, allocated once (outside graph pools), its
    error record in pinned host memory (read at the next call without a synchronisation)."""
    from ...runtime.persistent import allocate
    from . import expert_kernel as EK

    key = (w, e, c, block_m, str(dev))
    got = _counter_cache.get(key)
    if got is None:
        got = _counter_cache[key] = allocate(lambda: EK.Counters.make(w, e, c, block_m, dev, pinned_err=True))
    return got


def _check_expert_kernels() -> None:
    """Raise a bounded wait of an earlier call's expert kernel that ran past its bound (its record
    is in pinned memory: read without a synchronisation; a device-memory record is left for
    expert_kernel.check_errors after a synchronisation)."""
    from . import expert_kernel as EK

    for counters in _counter_cache.values():
        if counters.err.is_pinned() and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            EK.check_errors(counters.err)
