"""Post-grad-like graphs for finder and rewrite tests, built with make_fx from functional collectives.

Each case is a function of (group_name, world) returning (fn, example input shapes); the fn
uses ``torch.ops._c10d_functional`` exactly as Inductor's post-grad graphs do.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def wait(t):
    return c10d.wait_tensor.default(t)


def trace(fn, inputs, mode: str = "fake"):
    return make_fx(fn, tracing_mode=mode)(*inputs)


def gemm_allreduce(g, w, m=24, n=20, k=12, bias=False, op="sum", reader="relu"):
    """``reader``: what reads the all-reduce's result: "relu", "rmsnorm" (residual add + RMSNorm,
    a Llama block's next ops), "mm" (a GEMM) or "output" (returned as it is)."""
    def fn(a, b, c):
        y = aten.addmm.default(c, a, b) if bias else aten.mm.default(a, b)
        y = aten.view.default(y, [2, m // 2, n])
        out = wait(c10d.all_reduce.default(y, op, g))
        if reader == "output":
            return out
        if reader == "mm":
            return aten.mm.default(aten.view.default(out, [m, n]), aten.t.default(b))
        if reader == "rmsnorm":
            x = aten.add.Tensor(out, 1.5)
            var = aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True)
            return aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Tensor(var, 1e-6)))
        return aten.relu.default(out)

    return fn, [(m, k), (k, n), (n,)]


def gemm_reducescatter_dim0(g, w, m=None, n=20, k=12, bias=False, op="sum"):
    m = m or 6 * w

    def fn(a, b, c):
        y = aten.addmm.default(c, a, b) if bias else aten.mm.default(a, b)
        return wait(c10d.reduce_scatter_tensor.default(y, op, w, g)) * 2

    return fn, [(m, k), (k, n), (n,)]


def gemm_reducescatter_dim1(g, w, batch=2, seq=None, n=20, k=12, op="sum", form="split"):
    """DTensor's Shard(1) reduce-scatter: view [B, S, N] -> split(S/W, dim 1) -> cat(dim 0) -> RS.
    ``form="slice"``: W slices instead of the split (reduce_scatter_tensor_autograd's form)."""
    seq = seq or 3 * w

    def fn(a, b, c):
        y = aten.view.default(aten.mm.default(a, b), [batch, seq, n])
        c_ = seq // w
        parts = ([aten.slice.Tensor(y, 1, i * c_, (i + 1) * c_) for i in range(w)] if form == "slice"
                 else aten.split.Tensor(y, c_, 1))
        x = aten.cat.default(list(parts))
        return wait(c10d.reduce_scatter_tensor.default(x, op, w, g)) + 1

    return fn, [(batch * seq, k), (k, n), (n,)]


def gemm_sum_reducescatter(g, w, m=None, n=20, k1=12, k2=8):
    """Backward of two column-parallel projections: RS(mm(a1, b1) + mm(a2, b2))."""
    m = m or 4 * w

    def fn(a1, b1, a2, b2):
        y = aten.add.Tensor(aten.mm.default(a1, b1), aten.mm.default(a2, b2))
        return wait(c10d.reduce_scatter_tensor.default(y, "sum", w, g))

    return fn, [(m, k1), (k1, n), (m, k2), (k2, n)]


def allgather_gemm_dim0(g, w, m_local=5, k=12, ns=(20, 7), bias=False):
    def fn(x, b0, b1, c0):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        y0 = aten.addmm.default(c0, full, b0) if bias else aten.mm.default(full, b0)
        y1 = aten.mm.default(full, b1)
        return y0.sum(1), y1 * 3, full  # full is also returned (as a saved activation would be)

    return fn, [(m_local, k), (k, ns[0]), (k, ns[1]), (ns[0],)]


def allgather_gemm_dim1(g, w, batch=2, seq_local=3, k=12, n=20, form="split"):
    """DTensor's Shard(1) all-gather: AG on dim 0 -> split(B) -> cat(dim 1) -> view [B*S, K] -> mm.
    ``form="slice"``: W slices instead of the split (all_gather_tensor_autograd's form)."""

    def fn(x, b):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        parts = ([aten.slice.Tensor(full, 0, i * batch, (i + 1) * batch) for i in range(w)] if form == "slice"
                 else aten.split.Tensor(full, batch))
        seq = aten.cat.default(list(parts), 1)
        y = aten.mm.default(aten.view.default(seq, [batch * seq_local * w, k]), b)
        return y, seq.sum()

    return fn, [(batch, seq_local, k), (k, n)]


def allgather_gemm_batch1(g, w, seq_local=4, k=12, n=20, views=1):
    """What DTensor's Shard(1) all-gather becomes with batch 1: AG on dim 0 -> reshape [1, S, K]
    -> reshape [S, K] -> mm (no split/cat; the views keep K, so the row order is the gather's).
    ``views > 1``: an inference graph's form, one reshape [S, K] per GEMM (Q, K, V projections),
    each GEMM with its own weight of ``n + i`` columns."""

    def fn(x, *bs):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        seq = aten.reshape.default(full, [1, w * seq_local, k])
        ys = [aten.mm.default(aten.reshape.default(seq, [w * seq_local, k]), b) for b in bs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    return fn, [(1, seq_local, k)] + [(k, n + i) for i in range(views)]


def allgather_gemm_batch1_views(g, w, seq_local=4, k=12, n=20):
    return allgather_gemm_batch1(g, w, seq_local, k, n, views=3)


def gemm_alltoall(g, w, m=None, n=20, k=12, equal=True):
    m = m or 4 * w

    def fn(a, b):
        y = aten.mm.default(a, b)
        splits = [m // w] * w if equal else [m // w + 1] + [m // w] * (w - 2) + [m // w - 1]
        return wait(c10d.all_to_all_single.default(y, splits, splits, g)) - 1

    return fn, [(m, k), (k, n)]


def gemm_used_twice(g, w, m=16, n=20, k=12):
    def fn(a, b):
        y = aten.mm.default(a, b)
        return wait(c10d.all_reduce.default(y, "sum", g)), y.sum()

    return fn, [(m, k), (k, n)]


def allreduce_without_gemm(g, w):
    def fn(a):
        return wait(c10d.all_reduce.default(a * 2, "sum", g))

    return fn, [(8, 4)]


GEMM_COLLECTIVE_CASES = {
    "gemm_allreduce": gemm_allreduce,
    "gemm_reducescatter": gemm_reducescatter_dim0,
    "gemm_reducescatter_dim1": gemm_reducescatter_dim1,
    "gemm_sum_reducescatter": gemm_sum_reducescatter,
    "gemm_alltoall": gemm_alltoall,
    "allgather_gemm": allgather_gemm_dim0,
    "allgather_gemm_dim1": allgather_gemm_dim1,
    "allgather_gemm_batch1": allgather_gemm_batch1,
    "allgather_gemm_batch1_views": allgather_gemm_batch1_views,
}


def gemm_reducescatter_rowwise_allgather(g, w, m=None, n=32, k=12, escape=False, residual=False, weight=False):
    """RS -> row-wise ops (scale, RMSNorm without weight) -> all-gather: where the subtile form can
    move its row fix past the all-gather. ``escape`` also returns the RS output, ``residual`` adds
    a row-sharded tensor, ``weight`` multiplies by a row vector (not provably equal on all ranks):
    each rules the subtile form out."""
    m = m or 32 * w

    def fn(a, b, gamma, res):
        y = wait(c10d.reduce_scatter_tensor.default(aten.mm.default(a, b), "sum", w, g))
        h = aten.mul.Tensor(y, gamma) if weight else aten.mul.Scalar(y, 0.5)
        if residual:
            h = aten.add.Tensor(h, res)
        ms = aten.mean.dim(aten.mul.Tensor(h, h), [-1], True)
        h = aten.mul.Tensor(h, aten.rsqrt.default(aten.add.Scalar(ms, 1e-6)))
        full = aten.relu.default(wait(c10d.all_gather_into_tensor.default(h, w, g)))
        return (full, y) if escape else full

    return fn, [(m, k), (k, n), (n,), (m // w, n)]
