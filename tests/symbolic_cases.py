"""Post-grad-like graphs whose row count is symbolic (torch.compile's dynamic shapes), for the
symbolic-site tests: each case is a function of (group_name, world) returning (fn, example
inputs' shapes, the dims of each input that are symbolic, a function of the symbolic length giving
the inputs' shapes). ``trace`` traces with only those dims symbolic, as a dynamic compile marks
them; sizes in the case functions come from the inputs, so they stay symbolic."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def wait(t):
    return c10d.wait_tensor.default(t)


def trace(fn, inputs, dynamic_dims):
    """make_fx of ``fn`` with ``dynamic_dims[i]`` of input i symbolic (one shape environment)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = []
    for t, dims in zip(inputs, dynamic_dims):
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())]
        fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
    return make_fx(fn, tracing_mode="fake")(*fakes)


def rewritten(fn, example, dynamic_dims, template: str):
    """``fn`` traced with its symbolic dims and rewritten by the pass with ``template`` forced:
    (the graph module, the pass's record of it), the op's per-M choices cleared for a fresh count."""
    from overlap_compile import config
    from overlap_compile.passes.pipeline import run_on_graph
    from overlap_compile.templates.bucketed import clear_choices

    gm = trace(fn, example, dynamic_dims)
    with config.patch(force_template=template):
        record = run_on_graph(gm.graph, config.current())
    gm.recompile()
    clear_choices()
    return gm, record


def allreduce_2d(g, w, n=20, k=12, bias=True):
    """mm(+bias) -> all_reduce -> relu; M = a's rows (any M)."""
    def fn(a, b, c):
        y = aten.addmm.default(c, a, b) if bias else aten.mm.default(a, b)
        return aten.relu.default(wait(c10d.all_reduce.default(y, "sum", g)))

    return fn, lambda s: [(s, k), (k, n), (n,)], [[0], [], []]


def allreduce_3d(g, w, batch=2, n=20, k=12):
    """A Llama block's row-parallel linear: x [B, S, K] -> [B*S, K] -> mm -> [B, S, N] -> all_reduce."""
    def fn(x, b):
        bs, s = x.shape[0], x.shape[1]
        y = aten.mm.default(aten.view.default(x, [bs * s, k]), b)
        return wait(c10d.all_reduce.default(aten.view.default(y, [bs, s, n]), "sum", g)) + 1

    return fn, lambda s: [(batch, s, k), (k, n)], [[1], []]


def reducescatter_dim0(g, w, n=20, k=12):
    """mm -> reduce_scatter (dim 0); M = W * s (a multiple of W, as the collective needs)."""
    def fn(a, b):
        y = aten.mm.default(a, b)
        return wait(c10d.reduce_scatter_tensor.default(y, "sum", w, g)) * 2

    return fn, lambda s: [(w * s, k), (k, n)], [[0], []]


def reducescatter_dim1(g, w, batch=2, n=20, k=12):
    """DTensor's Shard(1) reduce-scatter: the local [B, S/W, K] made [B, S, K] (as the all-gather
    before it would), [B*S, K] -> mm -> [B, S, N] -> split(S/W, 1) -> cat -> RS."""
    def fn(x, b):
        bs, s = x.shape[0], x.shape[1]
        full = aten.cat.default([aten.mul.Tensor(x, i + 1) for i in range(w)], 1)
        y = aten.view.default(aten.mm.default(aten.view.default(full, [bs * s * w, k]), b), [bs, s * w, n])
        x2 = aten.cat.default(list(aten.split.Tensor(y, s, 1)))
        return wait(c10d.reduce_scatter_tensor.default(x2, "sum", w, g)) + 1

    return fn, lambda s: [(batch, s, k), (k, n)], [[1], []]


def sum_reducescatter(g, w, n=20, k1=12, k2=8):
    """The backward of two column-parallel projections: RS(mm(a1, b1) + mm(a2, b2))."""
    def fn(a1, b1, a2, b2):
        y = aten.add.Tensor(aten.mm.default(a1, b1), aten.mm.default(a2, b2))
        return wait(c10d.reduce_scatter_tensor.default(y, "sum", w, g))

    return fn, lambda s: [(w * s, k1), (k1, n), (w * s, k2), (k2, n)], [[0], [], [0], []]


def alltoall(g, w, n=20, k=12):
    """mm -> all_to_all_single with equal splits (M // W each)."""
    def fn(a, b):
        y = aten.mm.default(a, b)
        part = a.shape[0] // w
        return wait(c10d.all_to_all_single.default(y, [part] * w, [part] * w, g)) - 1

    return fn, lambda s: [(w * s, k), (k, n)], [[0], []]


def allgather_dim0(g, w, k=12, ns=(20, 7)):
    """all_gather -> two GEMMs (one with bias); the gathered rows also returned (saved)."""
    def fn(x, b0, b1, c0):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        return aten.addmm.default(c0, full, b0).sum(1), aten.mm.default(full, b1) * 3, full

    return fn, lambda s: [(s, k), (k, ns[0]), (k, ns[1]), (ns[0],)], [[0], [], [], []]


def allgather_dim1(g, w, batch=2, k=12, n=20):
    """DTensor's Shard(1) all-gather: AG dim 0 -> split(B) -> cat(dim 1) -> view [B*S, K] -> mm;
    the [B, S, K] tensor also read (un-flattened)."""
    def fn(x, b):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        seq = aten.cat.default(list(aten.split.Tensor(full, batch)), 1)
        y = aten.mm.default(aten.view.default(seq, [batch * seq.shape[1], k]), b)
        return y, seq * 2

    return fn, lambda s: [(batch, s, k), (k, n)], [[1], []]


def allgather_size_read(g, w, k=12, n=20):
    """Megatron's layout: [S / W, B, K] gathered on dim 0, flattened for the GEMM, and the GEMM's
    output viewed back with the gathered tensor's size read off it (a dynamic compile's sym_size)."""
    def fn(x, b):
        full = wait(c10d.all_gather_into_tensor.default(x, w, g))
        y = aten.mm.default(aten.view.default(full, [full.shape[0], k]), b)
        return aten.view.default(y, [full.shape[0], 1, n])

    return fn, lambda s: [(s, 1, k), (k, n)], [[0], []]


CASES = {
    "allreduce_2d": allreduce_2d,
    "allreduce_3d": allreduce_3d,
    "reducescatter_dim0": reducescatter_dim0,
    "reducescatter_dim1": reducescatter_dim1,
    "sum_reducescatter": sum_reducescatter,
    "alltoall": alltoall,
    "allgather_dim0": allgather_dim0,
    "allgather_dim1": allgather_dim1,
    "allgather_size_read": allgather_size_read,
}
KIND = {"allreduce_2d": "gemm_allreduce", "allreduce_3d": "gemm_allreduce", "reducescatter_dim0": "gemm_reducescatter",
        "reducescatter_dim1": "gemm_reducescatter", "sum_reducescatter": "gemm_reducescatter",
        "alltoall": "gemm_alltoall", "allgather_dim0": "allgather_gemm", "allgather_dim1": "allgather_gemm",
        "allgather_size_read": "allgather_gemm"}
