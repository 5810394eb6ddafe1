"""p2p_ring, step by step on any device (the oracle for a GPU implementation).

CommFuse (arXiv 2604.24013) replaces a collective beside a GEMM by W-1 point-to-point steps around
a ring, cutting the GEMM so that step s's transfer runs while step s+1 is computed:

    reduce-scatter  step s (0..W-1): compute my partial of stripe d = r - s - 1, add the sum
                    received from the left, pass it right. At s = W-1 the stripe is my own: the
                    last thing computed is the result itself, no communication tail.
    all-gather      step 0 computes my own shard's rows while it travels right; step s computes
                    shard r - s, which arrived during step s-1 and is forwarded meanwhile.
    all-to-all      W-1 pairwise exchanges, farthest first (send to r - s, receive from r + s);
                    the block that stays here is computed last.
    all-reduce      the reduce-scatter over W row stripes (m a multiple of W), then the
                    all-gather of the reduced stripes, with no GEMM to hide it.

``slices``: ring messages cut into row slices; ``bidirectional``: two half-rings in opposite
directions. Transport: ``batch_isend_irecv`` pairs (single sends around a ring would deadlock).
Partial sums in fp32, rounded to the dtype once per hop.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
import torch.distributed as dist

from ...runtime import comm
from ...tiling import RowStripes
from ..base import gemm_tile
from ..plans import AllGatherGemmPlan, GemmCollectivePlan, allreduce_chunks, allreduce_gather, allreduce_stripes

CONFIG_KEYS = ("slices", "bidirectional", "transport", "chunks")
# "nccl": torch.distributed send/recv (NCCL kernels on GPUs, gloo on CPU; kernels_nccl.py on
# CUDA). "p2p": copy-engine peer copies over symmetric memory (kernels.py, GPUs of one node, row
# stripes); where that path cannot run, this reference computes the same result with send/recv.
TRANSPORTS = ("nccl", "p2p")
REDUCE_OPS = ("sum", "avg")
KINDS = ("gemm_reducescatter", "allgather_gemm", "gemm_alltoall", "gemm_allreduce")


# ---- configuration ---------------------------------------------------------------------------

def config_problem(kind: str, config: Any) -> str | None:
    """Why ``config`` is not a valid p2p_ring configuration for a site of ``kind`` (None: valid)."""
    if not isinstance(config, dict):
        return f"config must be a dict with keys {list(CONFIG_KEYS)}, got {config!r}"
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        return f"unknown config keys {unknown}; allowed: {list(CONFIG_KEYS)}"
    slices = config.get("slices", 1)
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        return f"config 'slices' must be an integer >= 1, got {slices!r}"
    bidir = config.get("bidirectional", False)
    if not isinstance(bidir, bool):
        return f"config 'bidirectional' must be True or False, got {bidir!r}"
    if bidir and kind == "gemm_alltoall":
        return "config 'bidirectional' has no meaning for all-to-all (every pair exchanges directly)"
    transport = config.get("transport", "nccl")
    if transport not in TRANSPORTS:
        return f"config 'transport' must be one of {list(TRANSPORTS)}, got {transport!r}"
    if transport == "p2p" and bidir:
        return "transport 'p2p' (copy engine) runs one direction: bidirectional=False"
    chunks = config.get("chunks", 1)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"config 'chunks' must be an integer >= 1, got {chunks!r}"
    if chunks > 1 and kind != "gemm_allreduce":
        return f"config 'chunks' (the all-reduce's row chunks in a pipeline) has no meaning for {kind}"
    return None


def check_config(kind: str, config: Any) -> None:
    problem = config_problem(kind, config)
    if problem:
        raise ValueError(f"p2p_ring: {problem}")


# ---- geometry --------------------------------------------------------------------------------

def bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into ``min(parts, size)`` nearly equal, non-empty half-open ranges.

    Clamping (rather than refusing more slices than rows) keeps any config valid on any shape;
    every rank computes the same ranges, so the messages still pair up."""
    parts = max(1, min(parts, size))
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


@dataclasses.dataclass(frozen=True)
class Lane:
    """One ring direction and the share of the data it carries.

    ``direction`` +1 sends to rank r+1 and receives from r-1; -1 the other way round. ``span`` is
    a half-open range of columns (reduce-scatter) or of shard rows (all-gather)."""

    direction: int
    span: tuple[int, int]


def lanes(size: int, bidirectional: bool) -> list[Lane]:
    """The rings to run: one over all of ``size``, or two over its halves (empty halves dropped)."""
    if not bidirectional:
        return [Lane(1, (0, size))]
    half = size // 2
    both = [Lane(1, (0, half)), Lane(-1, (half, size))]
    return [lane for lane in both if lane.span[1] > lane.span[0]]


def stripe_rows(stripes: RowStripes, k: int, lo: int, hi: int) -> torch.Tensor:
    """Global row indices of local rows ``[lo, hi)`` of stripe ``k``."""
    return stripes.global_row(k, torch.arange(lo, hi))


def put_rows(out: torch.Tensor, stripes: RowStripes, k: int, lo: int, hi: int, rows: torch.Tensor) -> None:
    """Write local rows ``[lo, hi)`` of stripe ``k`` into the full matrix ``out``."""
    if (lo, hi) == (0, stripes.stripe_rows):
        stripes.place(out, k, rows)
    else:
        out.index_copy_(0, stripe_rows(stripes, k, lo, hi).to(out.device), rows)


def gemm_f32(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, rows: Any, cols: slice) -> torch.Tensor:
    """One block of ``a @ b + bias`` left in fp32 (the accumulator, before the epilogue rounds)."""
    if isinstance(rows, torch.Tensor):
        rows = rows.to(a.device)
    acc = a[rows].float() @ b[:, cols].float()
    if bias is not None:
        acc = acc + bias[cols].float()
    return acc


# ---- ring order (shared with kernels.py) ------------------------------------------------------

def rs_stripe(r: int, w: int, s: int, direction: int = 1) -> int:
    """Reduce-scatter step ``s`` (0..W-1) of rank ``r``: the stripe whose partial it computes.
    The last step (s = W-1) is ``r`` itself: the result is the last thing computed."""
    return (r - direction * (s + 1)) % w


def ag_source(r: int, w: int, s: int, direction: int = 1) -> int:
    """All-gather step ``s`` (0..W-1) of rank ``r``: whose shard's rows it computes (s = 0: its own)."""
    return (r - direction * s) % w


def a2a_pair(r: int, w: int, s: int) -> tuple[int, int]:
    """All-to-all exchange ``s`` (1..W-1) of rank ``r``: (destination, source), farthest first."""
    return (r - s) % w, (r + s) % w


# ---- transport -------------------------------------------------------------------------------

@dataclasses.dataclass
class Batch:
    """The work handles of one posted batch; ``done`` once waited (gloo counts completions, so
    waiting twice on a send would wait for a second send that never comes)."""

    works: list[Any]
    what: str
    done: bool = False


class Ring:
    """Point-to-point messages of one op call on the site's process group (group-local ranks).

    ``exchange`` posts one batch (a send and/or a receive) and returns it; ``wait`` blocks on it,
    bounded by the plan's timeout so that a peer that never answers becomes an error, not a hang.
    ``finish`` waits for everything still in flight (the last sends)."""

    def __init__(self, group_name: str, world: int, timeout_ms: int, template: str = "p2p_ring") -> None:
        self.pg = comm.resolve_group(group_name)
        self.rank, self.world = self.pg.rank(), self.pg.size()
        if self.world != world:
            raise ValueError(
                f"{template}: the plan is for {world} ranks but group {group_name!r} has {self.world}"
            )
        self.group_name = group_name
        self.timeout = datetime.timedelta(milliseconds=timeout_ms)
        self.in_flight: list[Batch] = []

    def peer(self, offset: int) -> int:
        return (self.rank + offset) % self.world

    def exchange(self, tag: int, send: tuple[torch.Tensor, int] | None = None,
                 recv: tuple[torch.Tensor, int] | None = None) -> Batch:
        ops = []
        if send is not None:
            t, dst = send
            ops.append(dist.P2POp(dist.isend, t.contiguous(), group=self.pg, tag=tag, group_peer=dst))
        if recv is not None:
            t, src = recv
            ops.append(dist.P2POp(dist.irecv, t, group=self.pg, tag=tag, group_peer=src))
        what = (f"message {tag}" + (f", send to rank {send[1]}" if send else "")
                + (f", receive from rank {recv[1]}" if recv else ""))
        batch = Batch([w for w in dist.batch_isend_irecv(ops) if w is not None], what)
        self.in_flight.append(batch)
        return batch

    def wait(self, batch: Batch) -> None:
        if batch.done:
            return
        for w in batch.works:
            try:
                w.wait(self.timeout)
            except RuntimeError as e:
                raise RuntimeError(
                    f"p2p_ring: rank {self.rank} of group {self.group_name!r} gave up on {batch.what} after "
                    f"{self.timeout.total_seconds():.1f}s (signal_timeout_ms); a peer is not running the same "
                    f"plan or has failed"
                ) from e
        batch.done = True

    def finish(self) -> None:
        for batch in self.in_flight:
            self.wait(batch)
        self.in_flight.clear()


# ---- reduce-scatter --------------------------------------------------------------------------

def _reduce_scatter(a, b, bias, group_name: str, plan: GemmCollectivePlan) -> torch.Tensor:
    """Ring reduce-scatter of ``a @ b + bias``: rank r returns the reduced stripe r."""
    if plan.reduce_op not in REDUCE_OPS:
        raise ValueError(f"p2p_ring: reduce op {plan.reduce_op!r} is not supported (supported: {list(REDUCE_OPS)})")
    ring = Ring(group_name, plan.world, plan.timeout_ms)
    r, w, st = ring.rank, plan.world, plan.stripes
    out = a.new_empty(plan.result_rows, plan.n)
    parts = bounds(st.stripe_rows, plan.config.get("slices", 1))
    ring_lanes = lanes(plan.n, plan.config.get("bidirectional", False))
    received: dict[tuple[int, int], tuple[torch.Tensor, Batch]] = {}  # (slice, lane) -> (running sum, batch)
    tag = 0
    for s in range(w):
        for q, (lo, hi) in enumerate(parts):
            for li, lane in enumerate(ring_lanes):
                cols = slice(*lane.span)
                dest = rs_stripe(r, w, s, lane.direction)  # s = W-1: dest = r, my own stripe
                acc = gemm_f32(a, b, bias, stripe_rows(st, dest, lo, hi), cols)
                if s > 0:  # the running sum of this stripe from the previous rank on this lane
                    buf, handle = received.pop((q, li))
                    ring.wait(handle)
                    acc = acc + buf.float()
                if s < w - 1:
                    total = acc.to(a.dtype)
                    buf = torch.empty_like(total)
                    handle = ring.exchange(tag, send=(total, ring.peer(lane.direction)),
                                           recv=(buf, ring.peer(-lane.direction)))
                    received[(q, li)] = (buf, handle)
                    tag += 1
                else:
                    if plan.reduce_op == "avg":
                        acc = acc / w
                    out[lo:hi, cols] = acc.to(a.dtype)
    ring.finish()
    return out


# ---- all-to-all ------------------------------------------------------------------------------

def _all_to_all(a, b, bias, group_name: str, plan: GemmCollectivePlan) -> torch.Tensor:
    """Pairwise all-to-all of ``a @ b + bias`` (equal splits): block j of the result is source
    j's stripe r."""
    if plan.outer != 1:
        raise ValueError("p2p_ring: all-to-all needs the split along the leading dimension (outer == 1)")
    ring = Ring(group_name, plan.world, plan.timeout_ms)
    r, w, st = ring.rank, plan.world, plan.stripes
    out = a.new_empty(plan.m, plan.n)
    cols = slice(0, plan.n)
    parts = bounds(st.stripe_rows, plan.config.get("slices", 1))
    arrivals = []
    tag = 0
    for s in range(1, w):  # farthest first: rank r - s is W - s hops away along the ring
        dst, src = a2a_pair(r, w, s)
        for lo, hi in parts:
            block = gemm_tile(a, b, bias, stripe_rows(st, dst, lo, hi).to(a.device), cols)
            buf = torch.empty_like(block)
            arrivals.append((src, lo, hi, buf, ring.exchange(tag, send=(block, dst), recv=(buf, src))))
            tag += 1
    for lo, hi in parts:  # the block that stays here, while the last exchanges are in flight
        put_rows(out, st, r, lo, hi, gemm_tile(a, b, bias, stripe_rows(st, r, lo, hi).to(a.device), cols))
    for src, lo, hi, buf, handle in arrivals:
        ring.wait(handle)
        put_rows(out, st, src, lo, hi, buf)
    ring.finish()
    return out


# ---- all-reduce = reduce-scatter + all-gather of the reduced stripes ----------------------------

def _all_reduce(a, b, bias, group_name: str, plan: GemmCollectivePlan) -> torch.Tensor:
    """Per row chunk (``"chunks"``, plans.allreduce_chunks; one by default): the reduce-scatter
    over its W stripes, then the gather of the reduced stripes."""
    parts = []
    for lo, hi, sub in allreduce_chunks(plan):
        mine = _reduce_scatter(a[lo:hi], b, bias, group_name, allreduce_stripes(sub))
        parts.append(run_allgather(mine, [], [], group_name, allreduce_gather(sub))[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def out_shape(plan: GemmCollectivePlan) -> tuple[int, int]:
    """The op returns the collective's result rows as a matrix (no glue needed)."""
    return (plan.result_rows, plan.n)


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan) -> torch.Tensor:
    check_config(plan.kind, plan.config)
    if plan.kind == "gemm_reducescatter":
        return _reduce_scatter(a, b, bias, group_name, plan)
    if plan.kind == "gemm_alltoall":
        return _all_to_all(a, b, bias, group_name, plan)
    if plan.kind == "gemm_allreduce":
        return _all_reduce(a, b, bias, group_name, plan)
    raise ValueError(f"p2p_ring does not implement {plan.kind} (it implements {', '.join(KINDS)})")


# ---- all-gather -> GEMMs ---------------------------------------------------------------------

def _compute_rows(part: torch.Tensor, src: int, lo: int, hi: int, bs, biases, outs, st: RowStripes) -> None:
    """Rows ``[lo, hi)`` of shard ``src``: place them in the gathered matrix and every GEMM output."""
    put_rows(outs[0], st, src, lo, hi, part)
    every = slice(None)
    for b, bias, y in zip(bs, biases, outs[1:]):
        put_rows(y, st, src, lo, hi, gemm_tile(part, b, bias, every, every))


def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None], group_name: str,
                  plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    """Ring all-gather of the shards feeding ``gathered @ b_i + bias_i``; returns
    ``[gathered, y_0, y_1, ...]``."""
    check_config("allgather_gemm", plan.config)
    _check_consumers(bs, biases, plan)
    ring = Ring(group_name, plan.world, plan.timeout_ms)
    r, w, st = ring.rank, plan.world, plan.stripes
    outs = [shard.new_empty(plan.m, plan.k)] + [shard.new_empty(plan.m, n) for n in plan.ns]
    shard = shard.contiguous()
    # Messages of one step, in the order every rank posts them: (lane, local rows of the shard).
    pieces = [(lane, lo, hi) for lane in lanes(st.stripe_rows, plan.config.get("bidirectional", False))
              for lo, hi in _offset(bounds(lane.span[1] - lane.span[0], plan.config.get("slices", 1)), lane.span[0])]
    # Step 0: my shard starts travelling before I compute anything, then I compute its rows.
    inbox = [_forward(ring, shard[lo:hi], lane, tag) for tag, (lane, lo, hi) in enumerate(pieces)]
    _compute_rows(shard, r, 0, st.stripe_rows, bs, biases, outs, st)
    for s in range(1, w):
        nxt = []
        for i, (lane, lo, hi) in enumerate(pieces):
            buf, handle = inbox[i]
            ring.wait(handle)
            if s < w - 1:  # pass it on before computing with it
                nxt.append(_forward(ring, buf, lane, s * len(pieces) + i))
            _compute_rows(buf, ag_source(r, w, s, lane.direction), lo, hi, bs, biases, outs, st)
        inbox = nxt
    ring.finish()
    return outs


def _forward(ring: Ring, piece: torch.Tensor, lane: Lane, tag: int) -> tuple[torch.Tensor, Batch]:
    """Send ``piece`` on along ``lane`` and post the receive of the next one from the other side."""
    buf = torch.empty_like(piece)
    handle = ring.exchange(tag, send=(piece, ring.peer(lane.direction)), recv=(buf, ring.peer(-lane.direction)))
    return buf, handle


def _offset(ranges: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    return [(lo + start, hi + start) for lo, hi in ranges]


def _check_consumers(bs, biases, plan: AllGatherGemmPlan) -> None:
    if len(bs) != len(plan.ns) or len(biases) != len(plan.ns):
        raise ValueError(
            f"p2p_ring: {len(bs)} weights and {len(biases)} biases for a plan with {len(plan.ns)} GEMMs"
        )
    for i, (bias, has, n) in enumerate(zip(biases, plan.has_bias, plan.ns)):
        if (bias is not None) != has:
            raise ValueError(f"p2p_ring: GEMM {i}: bias given={bias is not None} but plan says has_bias={has}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"p2p_ring: GEMM {i}: bias shape {tuple(bias.shape)} != ({n},)")
