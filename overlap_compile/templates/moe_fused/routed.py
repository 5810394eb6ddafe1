"""moe_fused with ``"payload": "routed"``: only the routed tokens travel and go through the experts.

The dispatch buffer is capacity-padded, ``[W, E_local, C, H]``: slot (d, e, p) holds a token for
rank d's expert e or, past the tokens routed there, zeros. A bias-free SwiGLU expert maps a zero
row to a zero row exactly (silu(0) = 0, 0 * w = 0), so the rows after the last non-zero row of
each (destination, expert) need neither travel nor be computed: their outputs, and the
intermediates a training graph saves, are zeros, written here. That holds for any buffer,
whatever the router wrote: no assumption on how slots are filled. (demo.moe fills each expert's
slots from row 0 up, so "rows up to the last non-zero one" are exactly the tokens routed there.)

    sizes[d, e]    = 1 + the last non-zero row of slots[d, e] (0: none)        on the device
    arrivals[s, e] = source s's sizes for my expert e                          one all-to-all of W * E int32
    one host synchronisation reads both (what every transfer's size needs), then the by-source
    pipeline of reference.run_by_source on packed pieces:
      piece to d   rows [0, sizes[d, e]) of every expert e, packed expert after expert
      experts      grouped GEMMs over the packed rows (torch._grouped_mm where it runs, else one
                   mm per expert): nothing computed for the padding
      combine      the packed results go home; the receiver scatters them into their slots, zeros
                   in the rest

Transfers: functional collectives (any device: gloo on CPU) or, on CUDA with NCCL, the pieces on
the high-priority communication stream ordered by events, as kernels_nccl.py does (``Link``).

What it costs against FlashDMoE's payload-efficient dispatch (sizes on the device, no host round
trip): the host synchronisation drains the GPU queue once per call and cannot be captured in a
CUDA graph, so under capture the op runs the capacity pipeline (op.py), whose outputs are the same
(padding rows computed as zeros). Expert weights with inf/NaN: the section as written turns its
padding rows into NaN (0 * inf), this path keeps them zero; the combine never reads padding rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...runtime import comm
from ..plans import MoePlan
from . import reference as ref

c10d = torch.ops._c10d_functional


def routed_sizes(slots: torch.Tensor) -> torch.Tensor:
    """``[..., C, H]`` -> int32 ``[...]``: 1 + the index of the last row with a non-zero entry (0
    when every row is zero). NaN counts as non-zero (such a row must travel)."""
    nonzero = slots.ne(0).any(-1)
    position = torch.arange(1, slots.shape[-2] + 1, device=slots.device, dtype=torch.int32)
    return (nonzero.to(torch.int32) * position).amax(-1)


def packed_rows(sizes: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """Flat row indices of groups packed one after the other: group g's rows ``starts[g] ..
    starts[g] + sizes[g] - 1``; ``total`` = sizes.sum() (known on the host, so no synchronisation)."""
    sizes = sizes.reshape(-1).long()
    before = torch.cumsum(sizes, 0) - sizes  # where each group begins in the packed order
    shift = torch.repeat_interleave(starts.reshape(-1).long() - before, sizes, output_size=total)
    return shift + torch.arange(total, device=sizes.device)


def _grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm takes these operands: CPU (any float dtype), or CUDA bf16 on sm90+; row
    strides of 16-byte multiples either way."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, w))
    if x.device.type == "cpu":
        return aligned
    return (aligned and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [N, K] packed by expert (``sizes`` rows each, ``offsets`` their device cumsum, int32)
    times ``w[e]`` [K, M] -> [N, M]."""
    if _grouped_mm_runs(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    out = x.new_empty(x.shape[0], w.shape[2])
    lo = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(x[lo:lo + n], w[e], out=out[lo:lo + n])
        lo += n
    return out


def grouped_swiglu(x: torch.Tensor, sizes: list[int], offsets: torch.Tensor, w1, w3, w2
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SwiGLU over packed rows: (y, the intermediates by MoePlan.saves role)."""
    gate, up = grouped_mm(x, w1, sizes, offsets), grouped_mm(x, w3, sizes, offsets)
    act = F.silu(gate) * up
    return grouped_mm(act, w2, sizes, offsets), {"tokens": x, "gate": gate, "up": up, "act": act}


class FunctionalLink:
    """Pairwise pieces over the asynchronous functional collectives (reference.py's transport)."""

    def __init__(self, group_name: str, world: int) -> None:
        self.group_name, self.world = group_name, world

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
        from .kernels_nccl import _used_on

        self.compute.wait_stream(self.side)
        _used_on(self.side, *self.used)


def link_for(group_name: str, device: torch.device, world: int):
    if device.type == "cuda":
        from . import kernels_nccl

        if kernels_nccl.usable(group_name, device):
            return StreamLink(group_name, device)
    return FunctionalLink(group_name, world)


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan, link=None) -> torch.Tensor | list[torch.Tensor]:
    """The combined slots ``[W * E_local * C, H]`` (zeros past each expert's last non-zero row),
    with ``plan.saves`` ``[that, *intermediates]`` as reference.run returns them."""
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    rank, size = comm.rank_and_size(group_name)
    if size != w:
        raise ValueError(f"moe_fused: group {group_name!r} has {size} ranks, the plan was made for {w}")
    link = link or link_for(group_name, buf.device, w)
    dev = buf.device
    flat = buf.view(w * e * c, h)
    sizes = routed_sizes(buf.view(w, e, c, h))                     # [W, E]: what I send to d's experts
    arrivals = link.exchange_sizes(sizes)                          # [W, E]: what source s sends mine
    on_host = torch.stack([sizes, arrivals]).cpu().tolist()        # the one synchronisation
    sent_rows, got_rows = on_host

    # slot (d, e, p) is flat row (d * E + e) * C + p; the saved layout [E, W * C, *] has source s's
    # rows of expert e at e * W * C + s * C + p
    slot_starts = torch.arange(w * e, device=dev).view(w, e) * c
    saved_starts = (torch.arange(e, device=dev) * (w * c)).view(1, e) + (torch.arange(w, device=dev) * c).view(w, 1)
    total = lambda rows: int(sum(rows))  # noqa: E731

    out = buf.new_zeros(w * e * c, h)
    saved = ref.Saved(plan, buf)
    for t in saved.tensors.values():
        t.zero_()
    saved_flat = {role: t.view(-1, t.shape[2]) for role, t in saved.tensors.items()}

    def experts_of(x: torch.Tensor, source: int) -> torch.Tensor:
        rows = got_rows[source]
        y, inter = grouped_swiglu(x, rows, torch.cumsum(arrivals[source], 0, dtype=torch.int32), w1, w3, w2)
        if saved_flat:
            idx = packed_rows(arrivals[source], saved_starts[source], total(rows))
            for role, t in saved_flat.items():
                t.index_copy_(0, idx, inter[role])
        return y

    # every dispatch piece packed and started first, in round order (the same on every rank) ...
    pieces = []
    for r in range(1, w):
        dst, src = ref.round_peers(rank, w, r)
        send = flat.index_select(0, packed_rows(sizes[dst], slot_starts[dst], total(sent_rows[dst])))
        pieces.append(link.start(send, dst, total(got_rows[src]), src, h))
    # ... the own tokens' experts run while they travel ...
    own_index = packed_rows(sizes[rank], slot_starts[rank], total(sent_rows[rank]))
    out.index_copy_(0, own_index, experts_of(flat.index_select(0, own_index), rank))
    backs = []
    for r, piece in enumerate(pieces, start=1):
        dst, src = ref.round_peers(rank, w, r)
        y = experts_of(link.finish(piece), src)
        # ... and each piece's results go home as soon as its experts are done
        backs.append((dst, link.start(y, src, total(sent_rows[dst]), dst, h)))
    for dst, back in backs:
        out.index_copy_(0, packed_rows(sizes[dst], slot_starts[dst], total(sent_rows[dst])), link.finish(back))
    link.close()
    return saved.result(out)
