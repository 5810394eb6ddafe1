"""moe_fused with ``"payload": "routed"``: only the routed tokens travel and go through the experts.

A bias-free SwiGLU maps a zero row to a zero row exactly, so the rows after the last non-zero row
of each (destination, expert) slot group need neither travel nor compute; their outputs and saved
intermediates are written as zeros. No assumption on how the router fills slots::

    sizes[d, e]    = 1 + the last non-zero row of slots[d, e] (0: none)        on the device
    arrivals[s, e] = source s's sizes for my expert e                          one all-to-all of W * E int32
    one host synchronisation reads both, then reference.run_by_source's pipeline, each piece:
      trimmed      [E, m, H], m = the fullest expert's rows (uniform routing): cuBLAS bmm
      packed       rows [0, sizes[d, e]) of every expert, one after the other (skewed routing):
                   grouped GEMMs over the routed rows only
      combine      results go home in the same layout; the receiver fills zeros in the rest

``exchange`` serves ``run`` and backward_reference.run_routed; links are ``FunctionalLink`` (any
device) or ``StreamLink`` (CUDA/NCCL, high-priority stream). The host synchronisation cannot be
captured, so under capture op.py runs the capacity pipeline instead (same outputs).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ...runtime import comm
from ..plans import MoePlan
from . import reference as ref
from .packed import grouped_mm_runs
from .swiglu_kernels import silu_mul, silu_mul_backward

c10d = torch.ops._c10d_functional


def runs_routed(config: dict, device: torch.device) -> bool:
    """Whether a call with this plan config takes the routed rounds here: a ``"payload": "routed"``
    plan does, but under CUDA-graph capture (no host read of the sizes inside a capture), where
    the capacity pipeline runs with the same outputs. Both ops (op.py, backward_op.py) ask this."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return config.get("payload") == "routed" and not capturing


def routed_sizes(slots: torch.Tensor) -> torch.Tensor:
    """``[..., C, H]`` -> int32 ``[...]``: 1 + the index of the last row with a non-zero entry (0
    when every row is zero); routed_sizes.py (a top-down scan on CUDA)."""
    from .routed_sizes import sizes

    return sizes(slots)


def packed_rows(sizes: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """Flat row indices of groups packed one after the other: group g's rows ``starts[g] ..
    starts[g] + sizes[g] - 1``; ``total`` = sizes.sum() (known on the host, so no synchronisation)."""
    sizes = sizes.reshape(-1).long()
    before = torch.cumsum(sizes, 0) - sizes  # where each group begins in the packed order
    shift = torch.repeat_interleave(starts.reshape(-1).long() - before, sizes, output_size=total)
    return shift + torch.arange(total, device=sizes.device)


# torch._grouped_mm (three launches per piece) from this many local experts, one cuBLAS mm per
# expert below it and wherever the grouped GEMM cannot run (fp32 / fp16 on CUDA, unaligned rows).
# One mm per expert leaves the pipeline host-bound (many launches of short GEMMs), though the
# grouped GEMM is slower per row than cuBLAS (benchmarks/diagnostics/moe_routed_experts.py).
GROUPED_FROM_EXPERTS = 1


def packed_mm(x: torch.Tensor, w: torch.Tensor, rows: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """Packed rows (expert j's ``rows[j]`` rows after expert j - 1's; ``offsets``: their device
    running sum, int32) times ``w[j]``: one torch._grouped_mm where it runs, one cuBLAS mm per
    expert with rows otherwise."""
    if len(rows) >= GROUPED_FROM_EXPERTS and grouped_mm_runs(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    y = x.new_empty(x.shape[0], w.shape[2])
    for j, (lo, n) in enumerate(zip(_starts(rows), rows)):
        if n:
            torch.mm(x[lo:lo + n], w[j], out=y[lo:lo + n])
    return y


def swiglu_packed(x: torch.Tensor, rows: list[int], offsets: torch.Tensor, w1, w3, w2
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SwiGLU of packed rows: (y, the intermediates by MoePlan.saves role, packed the same way)."""
    gate, up = packed_mm(x, w1, rows, offsets), packed_mm(x, w3, rows, offsets)
    act = silu_mul(gate, up)
    return packed_mm(act, w2, rows, offsets), {"tokens": x, "gate": gate, "up": up, "act": act}


def swiglu_grad_packed(g: torch.Tensor, rows: list[int], offsets: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       w1t, w3t, w2t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SwiGLU gradient of packed rows (backward_reference.swiglu_grad's formulas): (d_h,
    d_gate, d_up) for the gradient rows ``g`` and the forward's ``gate`` / ``up`` rows."""
    d_act = packed_mm(g, w2t, rows, offsets)
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    silu_mul_backward(d_act, gate, up, d_gate, d_up)
    d_h = packed_mm(d_up, w3t, rows, offsets).add_(packed_mm(d_gate, w1t, rows, offsets))
    return d_h, d_gate, d_up


def _starts(rows: list[int]) -> list[int]:
    at, out = 0, []
    for n in rows:
        out.append(at)
        at += n
    return out


class FunctionalLink:
    """Pairwise pieces over the asynchronous functional collectives (reference.py's transport)."""

    def __init__(self, group_name: str, world: int) -> None:
        self.group_name, self.world = group_name, world

    def rank_and_size(self) -> tuple[int, int]:
        return comm.rank_and_size(self.group_name)

    def exchange_sizes(self, sizes: torch.Tensor) -> torch.Tensor:
        split = [sizes.shape[1]] * self.world
        return comm.wait(c10d.all_to_all_single.default(sizes.reshape(-1), split, split, self.group_name)
                         ).view_as(sizes)

    def start(self, send: torch.Tensor, to: int, rows_in: int, source: int, width: int):
        return c10d.all_to_all_single.default(send, ref.one_peer_splits(self.world, source, rows_in),
                                              ref.one_peer_splits(self.world, to, send.shape[0]), self.group_name)

    def finish(self, handle) -> torch.Tensor:
        return comm.wait(handle)

    def close(self) -> None:
        pass


class StreamLink:
    """Pairwise pieces over NCCL on the communication stream (kernels_nccl.py's transport): a
    piece leaves once everything queued on the compute stream before it is done (its packing or
    its experts), the compute stream waits for its event before reading it."""

    def __init__(self, group_name: str, device: torch.device) -> None:
        from ..priority_stream.kernels import comm_stream

        self.pg = comm.resolve_group(group_name)
        self.compute, self.side = torch.cuda.current_stream(device), comm_stream(device)
        self.used: list[torch.Tensor] = []

    def rank_and_size(self) -> tuple[int, int]:
        return self.pg.rank(), self.pg.size()

    def exchange_sizes(self, sizes: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        got = torch.empty_like(sizes)
        dist.all_to_all_single(got, sizes, group=self.pg)
        return got

    def start(self, send: torch.Tensor, to: int, rows_in: int, source: int, width: int):
        import torch.distributed as dist

        w = self.pg.size()
        recv = send.new_empty(rows_in, width)
        self.side.wait_stream(self.compute)
        with torch.cuda.stream(self.side):
            dist.all_to_all_single(recv, send, ref.one_peer_splits(w, source, rows_in),
                                   ref.one_peer_splits(w, to, send.shape[0]), group=self.pg)
            landed = torch.cuda.Event()
            landed.record(self.side)
        self.used += [send, recv]
        return recv, landed

    def finish(self, handle) -> torch.Tensor:
        recv, landed = handle
        self.compute.wait_event(landed)
        return recv

    def close(self) -> None:
        """The join; what the side stream used is let go after it (templates/base.py)."""
        self.compute.wait_stream(self.side)
        self.used.clear()


def link_for(group_name: str, device: torch.device, world: int):
    if device.type == "cuda":
        from . import kernels_nccl

        if kernels_nccl.usable(group_name, device) is None:
            return StreamLink(group_name, device)
    return FunctionalLink(group_name, world)


# A piece travels and meets the experts in the trimmed layout [E, m, H] (m: its fullest expert's
# rows; bmm computes the few zero rows below m, exactly zero) when its rows fill at least this
# share of E * m, packed (grouped GEMM over the routed rows only) otherwise: the grouped GEMM
# takes about as long on that share of the rows as cuBLAS bmm on all of them
# (benchmarks/diagnostics/moe_routed_experts.py measures it).
TRIMMED_FROM_FILL = 0.8


def trimmed_rows(rows: list[int]) -> int | None:
    """m, the rows per expert of a trimmed piece, or None: the piece is packed. Both ends of a
    transfer know the piece's sizes, so they agree on its layout."""
    m = max(rows, default=0)
    return m if sum(rows) >= TRIMMED_FROM_FILL * len(rows) * m else None


def _piece_rows(rows: list[int]) -> int:
    m = trimmed_rows(rows)
    return sum(rows) if m is None else len(rows) * m


class _IndexMaps:
    """Flat row indices of the routed rows of every packed piece, built on first use for all
    pieces at once (a few launches in all, not per piece): ``slots(d)``, my rows for rank d's
    experts in the dispatch buffer (slot (d, j, p) is row (d * E + j) * C + p); ``saved(s)``,
    source s's rows in the saved layout [E, W * C, *] (row j * W * C + s * C + p)."""

    def __init__(self, w, e, c, dev, sizes, arrivals, sent_rows, got_rows) -> None:
        self.w, self.e, self.c, self.dev = w, e, c, dev
        self.sizes, self.arrivals, self.sent_rows, self.got_rows = sizes, arrivals, sent_rows, got_rows
        self._slots = self._saved = None

    def _cut(self, index: torch.Tensor, rows: list[list[int]], d: int) -> torch.Tensor:
        lo = sum(sum(r) for r in rows[:d])
        return index[lo:lo + sum(rows[d])]

    def slots(self, d: int) -> torch.Tensor:
        if self._slots is None:
            starts = torch.arange(self.w * self.e, device=self.dev) * self.c
            self._slots = packed_rows(self.sizes, starts, sum(map(sum, self.sent_rows)))
        return self._cut(self._slots, self.sent_rows, d)

    def saved(self, s: int) -> torch.Tensor:
        if self._saved is None:
            w, e, c = self.w, self.e, self.c
            starts = (torch.arange(e, device=self.dev).view(1, e) * (w * c)
                      + torch.arange(w, device=self.dev).view(w, 1) * c)
            self._saved = packed_rows(self.arrivals, starts, sum(map(sum, self.got_rows)))
        return self._cut(self._saved, self.got_rows, s)


@dataclasses.dataclass
class Routing:
    """What a piece's computation needs to read its rows: ``got_rows[s][j]`` (source s's rows for
    my expert j), ``offsets[1]`` [W, E] (their running sums, int32, for grouped GEMMs) and the
    packed pieces' index maps."""

    got_rows: list[list[int]]
    offsets: torch.Tensor
    maps: _IndexMaps


def exchange(buf: torch.Tensor, plan: MoePlan, group_name: str, piece: Callable, link=None,
             after: Callable[[], None] | None = None) -> torch.Tensor:
    """The routed rounds by source (the module docstring), both directions of a training step:
    ``buf`` [W * E * C, H] (slot block d goes to rank d). ``piece(x, source, routing)`` computes the
    rows received from ``source`` (the own ones first: no transfer): ``x`` is [E, m, H] (a trimmed
    piece, the own one possibly a strided view of the slots) or [routed rows, H] (packed), and the
    result in the same layout goes home at once; ``after()`` runs once every piece is computed,
    while the last results travel. Returns the results [W, E, C, H], zeros where no routed row
    lands."""
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    link = link or link_for(group_name, buf.device, w)
    rank, size = link.rank_and_size()
    if size != w:
        raise ValueError(f"moe_fused: group {group_name!r} has {size} ranks, the plan was made for {w}")
    slots, flat = buf.view(w, e, c, h), buf.view(w * e * c, h)
    sizes = routed_sizes(slots)                                    # [W, E]: what I send to d's experts
    arrivals = link.exchange_sizes(sizes)                          # [W, E]: what source s sends mine
    offsets = torch.cumsum(torch.stack([sizes, arrivals]), -1, dtype=torch.int32)  # for grouped GEMMs
    sent_rows, got_rows = torch.stack([sizes, arrivals]).cpu().tolist()  # the one synchronisation
    routing = Routing(got_rows, offsets, _IndexMaps(w, e, c, buf.device, sizes, arrivals, sent_rows, got_rows))
    # zeros where no routed row lands (one memset, few host calls); with inf/NaN weights the section
    # as written turns padding rows into NaN (0 * inf) and this keeps them zero (combine never reads them)
    out = buf.new_zeros(w, e, c, h)

    def outgoing(d: int) -> torch.Tensor:
        """My slots for rank d's experts as they travel: [E * m, H] trimmed, [routed rows, H] packed."""
        m = trimmed_rows(sent_rows[d])
        if m is not None:
            return slots[d, :, :m].reshape(e * m, h)
        return flat.index_select(0, routing.maps.slots(d))

    def place(d: int, result: torch.Tensor) -> None:
        """Results for my slots for rank d's experts (as outgoing laid them out) into out[d]."""
        rows = sent_rows[d]
        m = trimmed_rows(rows)
        if m is not None:
            out[d, :, :m].copy_(result.reshape(e, m, h))
        elif sum(rows):
            out.view(w * e * c, h).index_copy_(0, routing.maps.slots(d), result)

    # every piece laid out and started first, in round order (the same on every rank) ...
    pieces = []
    for r in range(1, w):
        dst, src = ref.round_peers(rank, w, r)
        pieces.append(link.start(outgoing(dst), dst, _piece_rows(got_rows[src]), src, h))
    # ... the own rows computed while they travel (a trimmed own piece straight from the slots) ...
    m = trimmed_rows(sent_rows[rank])
    place(rank, piece(outgoing(rank) if m is None else slots[rank, :, :m], rank, routing))
    backs = []
    for r, sent in enumerate(pieces, start=1):
        dst, src = ref.round_peers(rank, w, r)
        y = piece(link.finish(sent), src, routing).reshape(-1, h)
        # ... and each piece's results go home as soon as they are computed
        backs.append((dst, link.start(y, src, _piece_rows(sent_rows[dst]), dst, h)))
    if after is not None:
        after()
    for dst, back in backs:
        place(dst, link.finish(back))
    link.close()
    return out


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan, link=None) -> torch.Tensor | list[torch.Tensor]:
    """The combined slots ``[W * E_local * C, H]`` (zeros past each expert's last non-zero row),
    with ``plan.saves`` ``[that, *intermediates]`` as reference.run returns them."""
    e, c, h = plan.e_local, plan.capacity, plan.hidden
    saved = ref.Saved(plan, buf)
    for t in saved.tensors.values():
        t.zero_()  # the intermediates of zero rows

    def experts(x: torch.Tensor, source: int, routing: Routing) -> torch.Tensor:
        """A piece from ``source`` through the experts, its intermediates into the saved layout."""
        rows = routing.got_rows[source]
        m = trimmed_rows(rows)
        if m is not None:
            keep = {role: t[:, source * c:source * c + m] for role, t in saved.tensors.items()}
            return ref.experts(x.view(e, m, h), w1, w3, w2, keep=keep)
        y, inter = swiglu_packed(x, rows, routing.offsets[1, source], w1, w3, w2)
        for role, t in saved.tensors.items():
            t.view(-1, t.shape[2]).index_copy_(0, routing.maps.saved(source), inter[role])
        return y

    out = exchange(buf, plan, group_name, experts, link)
    return saved.result(out.view(-1, h))
