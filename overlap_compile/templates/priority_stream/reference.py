"""priority_stream, step by step on any device (the oracle for kernels.py).

Resource-aware overlap: the GEMM is cut into ``chunks`` pieces along M and chunk c's collective
starts as soon as chunk c is computed, so it runs while chunk c+1 is. Chunks (``Layout``):

    all-reduce       chunk c = a contiguous block of output rows [lo, hi); all_reduce of it.
    reduce-scatter   chunk c = local rows [lo, hi) of EVERY stripe (tiling.RowStripes), so the
    all-to-all       chunk's send buffer ``[W, q, n]`` (q = hi - lo) holds equally many rows for
                     every rank and is contiguous. reduce_scatter of it yields rows [lo, hi) of my
                     reduced stripe; all_to_all yields, for every source j, rows [lo, hi) of the
                     block that source sends me (result rows j*R + [lo, hi), R = rows per stripe).
    all-gather       chunk c = rows [lo, hi) of every rank's shard: all_gather gives ``[W, q, k]``,
                     placed into the gathered matrix and multiplied as soon as they land.

With ``outer > 1`` a chunk's rows may be a few strided segments, each one batched GEMM
(``gemm_into``), no rows copied. ``R`` rows split into ``min(chunks, R)`` chunks, the larger
first, so the last chunk (nothing hides its collective) is never the larger one. Bias is added
before any reduction: results equal eager up to the GEMM's summation order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ...runtime import comm
from ...tiling import RowStripes
from ..plans import AllGatherGemmPlan, GemmCollectivePlan

TEMPLATE = "priority_stream"
KINDS = ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall", "allgather_gemm")
CONFIG_KEYS = ("chunks", "block_m", "block_n", "stages", "programs")


# ---- configuration ---------------------------------------------------------------------------

def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def config_problem(config: Any) -> str | None:
    """Why ``config`` is not a valid priority_stream configuration (None: it is valid).

    ``chunks``: GEMM pieces along M (>= 1). ``block_m``/``block_n``/``stages``/``programs``: an
    optional GEMM tile config that shapes the GEMM's occupancy so that the collective's kernels
    co-reside (occupancy shaping): on GPUs the chunks then run on the persistent Triton GEMM
    (signal_reorder's) with that tile, that many pipeline stages (shared memory per block) and
    that many persistent programs (SMs it holds; None = all). block_m/block_n None = cuBLAS at
    its own tile choice. The reference (CPU) computes the same product either way.
    """
    if not isinstance(config, dict):
        return f"config must be a dict with keys {list(CONFIG_KEYS)}, got {config!r}"
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        return f"unknown config keys {unknown}; allowed: {list(CONFIG_KEYS)}"
    if not _positive_int(config.get("chunks", 1)):
        return f"config 'chunks' must be an integer >= 1, got {config.get('chunks')!r}"
    for key in ("block_m", "block_n", "stages", "programs"):
        v = config.get(key)
        if v is not None and not _positive_int(v):
            return f"config {key!r} must be None (cuBLAS) or an integer >= 1, got {v!r}"
    if (config.get("block_m") is None) != (config.get("block_n") is None):
        return "config 'block_m' and 'block_n' must be given together (a tile) or both be None (cuBLAS)"
    if config.get("block_m") is None and (config.get("stages") is not None or config.get("programs") is not None):
        return "config 'stages' and 'programs' shape the Triton GEMM: they need a tile ('block_m', 'block_n')"
    return None


def check_config(config: Any) -> None:
    problem = config_problem(config)
    if problem:
        raise ValueError(f"{TEMPLATE}: {problem}")


# ---- geometry --------------------------------------------------------------------------------

def bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``rows`` split into ``min(chunks, rows)`` half-open ranges, sizes differing by at most one,
    larger ones first (the last chunk's collective is the exposed tail: keep it small)."""
    n = max(1, min(chunks, rows))
    base, extra = divmod(rows, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclasses.dataclass(frozen=True)
class Segment:
    """Local rows ``[r0, r1)`` of outer block ``o`` of every stripe, at row ``off`` of the chunk."""

    o: int
    r0: int
    r1: int
    off: int

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


def segments(st: RowStripes, lo: int, hi: int) -> list[Segment]:
    """Local rows [lo, hi) of a stripe, cut where they cross an outer block (local row r lies in
    block r // chunk), so that each piece is one strided view per matrix (stripe_block)."""
    out, r = [], lo
    while r < hi:
        o, r0 = divmod(r, st.chunk)
        r1 = min(st.chunk, r0 + hi - r)
        out.append(Segment(o, r0, r1, r - lo))
        r += r1 - r0
    return out


def stripe_block(x: torch.Tensor, st: RowStripes, seg: Segment) -> torch.Tensor:
    """``[W, len, cols]`` view of a full ``[rows, cols]`` matrix: segment ``seg`` of every stripe
    (splitting dim 0 is always a view, whatever x's strides)."""
    return x.view(st.outer, st.world, st.chunk, x.shape[-1])[seg.o, :, seg.r0:seg.r1]


def chunk_block(buf: torch.Tensor, world: int, seg: Segment) -> torch.Tensor:
    """``[W, len, cols]`` view of one chunk's contiguous buffer ``[W * q, cols]`` (row j*q + i =
    row i of the chunk's part for rank j): the rows of segment ``seg``."""
    return buf.view(world, -1, buf.shape[-1])[:, seg.off:seg.off + seg.rows]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Stripes and chunk bounds of a site. All-reduce is one stripe of m rows (world 1 here: the
    chunk is just rows [lo, hi) of the matrix)."""

    stripes: RowStripes
    chunks: tuple[tuple[int, int], ...]

    @property
    def world(self) -> int:
        return self.stripes.world

    def buffer_rows(self, c: int) -> tuple[int, int]:
        """Rows of chunk c in a chunk-major buffer of ``[W * R, cols]`` (chunk c contiguous)."""
        lo, hi = self.chunks[c]
        return self.world * lo, self.world * hi

    def segments_of(self, c: int) -> list[Segment]:
        """Chunk c's rows of every stripe, one piece per outer block it touches."""
        return segments(self.stripes, *self.chunks[c])


def gemm_layout(plan: GemmCollectivePlan) -> Layout:
    """The chunks of a GEMM -> collective plan (validates kind and config: a bad plan fails here,
    on every rank alike, before anything is sent)."""
    if plan.kind not in KINDS[:3]:
        raise ValueError(f"{TEMPLATE}: a GEMM-collective plan of kind {plan.kind!r}; expected one of {list(KINDS[:3])}")
    check_config(plan.config)
    st = RowStripes(1, 1, plan.m) if plan.kind == "gemm_allreduce" else plan.stripes
    return Layout(st, tuple(bounds(st.stripe_rows, plan.config.get("chunks", 1))))


def allgather_layout(plan: AllGatherGemmPlan) -> Layout:
    """The chunks of an all-gather -> GEMM plan: rows of every rank's shard."""
    check_config(plan.config)
    return Layout(plan.stripes, tuple(bounds(plan.stripes.stripe_rows, plan.config.get("chunks", 1))))


def out_shape(plan: GemmCollectivePlan) -> tuple[int, int]:
    """The op's result: the collective's rows on this rank (the fake impl's shape)."""
    return (plan.result_rows, plan.n)


# ---- the GEMM of one chunk (shared with kernels.py) -------------------------------------------

def _as_matrix(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, L, C]`` as a ``[B*L, C]`` view when its rows are evenly strided, else None."""
    if x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1):
        return x.view(-1, x.shape[-1])
    return None


MatMul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
              mm: MatMul | None = None) -> None:
    """``out[j] = a[j] @ b (+ bias)`` for ``[W, len, .]`` views, written in place.

    One ``mm``/``addmm`` when both views are plain row ranges (all-reduce, outer == 1 with one
    chunk), else one ``bmm``/``baddbmm`` with b broadcast (batch stride 0): no operand copies.
    ``mm(a2, b, bias, out2)``: another 2-D GEMM writing into ``out2`` (the GPU path's Triton
    GEMM), called once per matrix (once per stripe where the rows are not one range).
    """
    a2, o2 = _as_matrix(a), _as_matrix(out)
    if mm is not None:
        pairs = [(a2, o2)] if a2 is not None and o2 is not None else list(zip(a, out))
        for x, y in pairs:
            mm(x, b, bias, y)
        return
    if a2 is not None and o2 is not None:
        if bias is None:
            torch.mm(a2, b, out=o2)
        else:
            torch.addmm(bias, a2, b, out=o2)
        return
    bb = b.expand(a.shape[0], *b.shape)
    if bias is None:
        torch.bmm(a, bb, out=out)
    else:
        torch.baddbmm(bias.expand(out.shape), a, bb, out=out)


def compute_chunk(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, lay: Layout, c: int,
                  send_c: torch.Tensor, mm: MatMul | None = None) -> None:
    """Chunk c of ``a @ b + bias`` into its contiguous send buffer ``[W * q, n]``."""
    for seg in lay.segments_of(c):
        gemm_into(chunk_block(send_c, lay.world, seg), stripe_block(a, lay.stripes, seg), b, bias, mm)


def place_gathered(gathered: torch.Tensor, gath_c: torch.Tensor, lay: Layout, c: int) -> None:
    """Chunk c of an all-gather (``[W * q, k]``, source-major) into the gathered ``[m, k]`` matrix."""
    for seg in lay.segments_of(c):
        stripe_block(gathered, lay.stripes, seg).copy_(chunk_block(gath_c, lay.world, seg))


def gemm_gathered(gath_c: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  ys: list[torch.Tensor], lay: Layout, c: int, mm: MatMul | None = None) -> None:
    """Every consumer's GEMM on chunk c of the gather, written to its rows of ``ys[i]``."""
    for seg in lay.segments_of(c):
        rows = chunk_block(gath_c, lay.world, seg)
        for b, bias, y in zip(bs, biases, ys):
            gemm_into(stripe_block(y, lay.stripes, seg), rows, b, bias, mm)


def place_received(result: torch.Tensor, recv_c: torch.Tensor, lay: Layout, c: int) -> None:
    """All-to-all chunk c (``[W * q, n]``, source-major) into result rows j*R + [lo, hi)."""
    lo, hi = lay.chunks[c]
    result.view(lay.world, -1, result.shape[-1])[:, lo:hi].copy_(recv_c.view(lay.world, hi - lo, -1))


# ---- the reference algorithm -----------------------------------------------------------------

def _start(kind: str, send_c: torch.Tensor, plan: GemmCollectivePlan, group_name: str) -> torch.Tensor:
    if kind == "gemm_allreduce":
        return comm.start_all_reduce(send_c, plan.reduce_op, group_name)
    if kind == "gemm_reducescatter":
        return comm.start_reduce_scatter(send_c, plan.reduce_op, plan.world, group_name)
    return comm.start_all_to_all(send_c, plan.world, group_name)


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan) -> torch.Tensor:
    """GEMM chunk by chunk; each chunk's collective starts (asynchronously) as soon as it is
    computed and is waited for only after the last chunk's GEMM. Returns ``[result_rows, n]``."""
    lay = gemm_layout(plan)
    send = a.new_empty(plan.m, plan.n)  # chunk-major: chunk c is send[W*lo : W*hi]
    pending = []
    for c in range(len(lay.chunks)):
        send_c = send[slice(*lay.buffer_rows(c))]
        compute_chunk(a, b, bias, lay, c, send_c)
        pending.append(_start(plan.kind, send_c, plan, group_name))
    done = [comm.wait(t) for t in pending]
    if plan.kind != "gemm_alltoall":
        return torch.cat(done) if len(done) > 1 else done[0]
    result = a.new_empty(plan.m, plan.n)
    for c, recv_c in enumerate(done):
        place_received(result, recv_c, lay, c)
    return result


def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  group_name: str, plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    """Every chunk's all-gather is started at once (they queue on the backend); chunk c's GEMMs
    run as soon as its gather has landed, while the later gathers are still in flight."""
    lay = allgather_layout(plan)
    shard = shard.contiguous()
    pending = [comm.start_all_gather(shard[lo:hi], plan.world, group_name) for lo, hi in lay.chunks]
    gathered = shard.new_empty(plan.m, plan.k)
    ys = [shard.new_empty(plan.m, n) for n in plan.ns]
    for c, t in enumerate(pending):
        gath_c = comm.wait(t)
        gemm_gathered(gath_c, bs, biases, ys, lay, c)
        place_gathered(gathered, gath_c, lay, c)
    return [gathered] + ys
