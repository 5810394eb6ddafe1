"""tile_fused's Triton kernels on the CPU through Triton's interpreter, W ranks simulated in one
process: each "rank" has its own CPU tensors and the peer pointer tables hold their addresses,
exactly as runtime.symm's tables hold the peers' symmetric-memory addresses on a GPU.

Inline asm does not run in the interpreter, so the kernels run with USE_ASM=False (tl.atomic_*
signals with the same semantics); everything else is the GPU code: the rank-ordered tile maps,
the GEMM's tile placement, the push/reduce channel loops, the signal protocol (every flag back
at zero after a call) and the bounded waits' error records. The ranks' kernels run phase by
phase (all GEMMs, then all pushes, then all reduces), which a correct protocol must allow.

The checks run in a subprocess with TRITON_INTERPRET=1 set before Triton is imported, so the
setting leaks into no other test.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", "import tests.test_tile_fused_interp as t; t.main()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "ALL OK" in proc.stdout, proc.stdout[-4000:]


# ---- what runs in the subprocess ------------------------------------------------------------------

def _gemm(K, mode, a, b, bias, c, flags, err, rows, n, k, tiles, world, rank, chunk, programs, bm, bn, max_polls=10):
    K._tile_gemm_kernel[(programs,)](
        a, None, b, None, bias if bias is not None else c, c, None, flags, err,
        rows, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0) if mode == K.MODE_AG else 0,
        tiles, world, rank, chunk, programs, 0, max_polls,
        MODE=mode, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=16, GROUP_M=2, A_TMA=False, B_TMA=False, B_KMAJOR=False,
        C_TMA=False, HAS_BIAS=bias is not None, FLATTEN=False, DOT_PRECISION="ieee", USE_ASM=False, USE_TIMER=False)


def check_reduce_scatter(world: int, outer: int, chunk: int, n: int, k: int, channels: int, avg: bool,
                         allreduce: bool = False) -> None:
    """The GEMM + reduce-scatter kernels, and with ``allreduce`` (outer 1) the reduce CTAs'
    pushes of the reduced tiles and the gather kernel: every rank ends with the whole sum."""
    import torch

    from overlap_compile.templates.tile_fused import kernels as K
    from overlap_compile.tiling import RowStripes, TileGrid

    torch.manual_seed(world * 100 + chunk)
    bm = bn = 16
    st = RowStripes(outer, world, chunk)
    grid = TileGrid(st.stripe_rows, n, bm, bn, 2)
    T = grid.num_tiles
    a = [torch.randn(st.rows, k) for _ in range(world)]
    b = [torch.randn(k, n) for _ in range(world)]
    bias = torch.randn(n)
    part = [torch.full((world * T, bm, bn), float("nan")) for _ in range(world)]
    ready = [torch.zeros(world * T, dtype=torch.int32) for _ in range(world)]
    recv = [torch.full((world * T, bm, bn), float("nan")) for _ in range(world)]
    arrived = [torch.zeros(world * T, dtype=torch.int32) for _ in range(world)]
    out = [torch.full(((world if allreduce else 1) * st.stripe_rows, n), float("nan")) for _ in range(world)]
    mine = [o[r * chunk:(r + 1) * chunk] if allreduce else o for r, o in enumerate(out)]
    gat = [torch.full((world * T, bm, bn), float("nan")) for _ in range(world)]
    done = [torch.zeros(world * T, dtype=torch.int32) for _ in range(world)]
    err = [torch.zeros(5, dtype=torch.int32) for _ in range(world)]
    recv_tbl = torch.tensor([t.data_ptr() for t in recv], dtype=torch.int64)
    arrived_tbl = torch.tensor([t.data_ptr() for t in arrived], dtype=torch.int64)
    gat_tbl = torch.tensor([t.data_ptr() for t in gat], dtype=torch.int64)
    done_tbl = torch.tensor([t.data_ptr() for t in done], dtype=torch.int64)
    for r in range(world):
        _gemm(K, K.MODE_RS, a[r], b[r], bias, part[r], ready[r], err[r], st.stripe_rows, n, k, T, world, r, chunk,
              3, bm, bn)
        assert ready[r].tolist() == [1] * (world * T), ready[r]
    for r in range(world):
        K._push_kernel[(channels,)](part[r], ready[r], recv_tbl, arrived_tbl, arrived[r], err[r], T, world, r, 0, 10,
                                    BM=bm, BN=bn, SUB_M=8, USE_ASM=False, USE_TIMER=False)
    for r in range(world):
        K._reduce_kernel[(channels,)](part[r], ready[r], recv[r], arrived[r], mine[r], err[r],
                                      gat_tbl, gat[r], done_tbl, done[r], st.stripe_rows, n,
                                      out[r].stride(0), T, world, r, 0, 10, 1.0 / world if avg else 1.0,
                                      BM=bm, BN=bn, SUB_M=8, GROUP_M=2, GATHER=allreduce, USE_ASM=False,
                                      USE_TIMER=False)
    if allreduce:
        for r in range(world):
            assert done[r].tolist() == [0 if q == r else 1 for q in range(world) for _ in range(T)], done[r]
            K._gather_kernel[(channels,)](gat[r], done[r], out[r], err[r], st.stripe_rows, n, out[r].stride(0),
                                          chunk, T, world, r, 0, 10, BM=bm, BN=bn, SUB_M=8, GROUP_M=2,
                                          USE_ASM=False, USE_TIMER=False)
    total = sum(a[q] @ b[q] + bias for q in range(world))
    if avg:
        total = total / world
    for r in range(world):
        assert err[r].tolist() == [0] * 5, (r, err[r])
        assert ready[r].abs().sum() == 0 and arrived[r].abs().sum() == 0, "signals not returned to zero"
        assert done[r].abs().sum() == 0, "gather signals not returned to zero"
        exp = total if allreduce else st.stripe(total, r)
        assert torch.allclose(out[r], exp, rtol=1e-4, atol=1e-4), (r, (out[r] - exp).abs().max())
    what = "all-reduce" if allreduce else "reduce-scatter"
    print(f"{what} W={world} outer={outer} chunk={chunk} n={n} channels={channels} ok")


def check_allgather(world: int, outer: int, chunk: int, n: int, k: int) -> None:
    import torch

    from overlap_compile.templates.tile_fused import kernels as K
    from overlap_compile.tiling import RowStripes, TileGrid

    torch.manual_seed(7 + chunk)
    bm = bn = 16
    st = RowStripes(outer, world, chunk)
    grid = TileGrid(st.stripe_rows, n, bm, bn, 2)
    gathered = torch.randn(st.rows, k)
    b = torch.randn(k, n)
    bias = torch.randn(n)
    for r in range(world):
        flags = torch.ones(world, dtype=torch.int32)
        err = torch.zeros(5, dtype=torch.int32)
        y = torch.full((st.rows, n), float("nan"))
        _gemm(K, K.MODE_AG, gathered, b, bias, y, flags, err, st.stripe_rows, n, k, grid.num_tiles, world, r, chunk,
              3, bm, bn)
        assert err.tolist() == [0] * 5
        assert torch.allclose(y, gathered @ b + bias, rtol=1e-4, atol=1e-4), (r, (y - gathered @ b - bias).abs().max())
    # A chunk that never arrives: the bounded wait records (failed, rank wait, its index, seen, target) and
    # every later wait returns at once (the kernel finishes).
    r, missing = 0, world - 1
    flags = torch.ones(world, dtype=torch.int32)
    flags[missing] = 0
    err = torch.zeros(5, dtype=torch.int32)
    y = torch.zeros(st.rows, n)
    _gemm(K, K.MODE_AG, gathered, b, None, y, flags, err, st.stripe_rows, n, k, grid.num_tiles, world, r, chunk, 2,
          bm, bn, max_polls=5)
    from overlap_compile.templates.tile_fused import primitives as P

    assert err.tolist() == [1, P.WAIT_RANK, missing, 0, 1], err
    msg = K._format_error(err.tolist(), "allgather_gemm")
    assert "tile_fused allgather_gemm" in msg and f"rank {missing}" in msg and "read 0" in msg, msg
    print(f"all-gather W={world} outer={outer} chunk={chunk} n={n} ok (timeout recorded: {msg[:70]}...)")


def check_barrier(world: int) -> None:
    import torch

    from overlap_compile.templates.tile_fused import kernels as K

    flags = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    tbl = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    err = [torch.zeros(5, dtype=torch.int32) for _ in range(world)]
    for _ in range(2):  # twice: the second round must not see leftovers of the first
        for r in range(world):
            K._barrier_kernel[(1,)](tbl, flags[r], err[r], world, r, 0, 10, NOTIFY=True, WAIT=False, USE_ASM=False,
                                    USE_TIMER=False)
        for r in range(world):
            assert flags[r].tolist() == [0 if q == r else 1 for q in range(world)]
        for r in range(world):
            K._barrier_kernel[(1,)](tbl, flags[r], err[r], world, r, 0, 10, NOTIFY=False, WAIT=True, USE_ASM=False,
                                    USE_TIMER=False)
        assert all(f.abs().sum() == 0 for f in flags) and all(e.abs().sum() == 0 for e in err)
    # a barrier a peer never joins: bounded, recorded
    K._barrier_kernel[(1,)](tbl, flags[0], err[0], world, 0, 0, 5, NOTIFY=False, WAIT=True, USE_ASM=False,
                            USE_TIMER=False)
    assert err[0].tolist()[:3] == [1, 3, 1], err[0]
    print(f"barrier W={world} ok")


def check_twins() -> None:
    """rank_ordered_jit (the kernels' twin) == tiling.RankOrderedTiles on every exec id."""
    import torch
    import triton
    import triton.language as tl

    from overlap_compile.templates.tile_fused import kernels as K
    from overlap_compile.tiling import RankOrderedTiles

    globals()["K"] = K  # the interpreter resolves a kernel's names in its module's globals

    @triton.jit
    def probe(out_ptr, n, rank, world, tiles, first, BLOCK: tl.constexpr):
        e = tl.arange(0, BLOCK)
        s, t = K.rank_ordered_jit(e, rank, world, tiles, first)
        tl.store(out_ptr + e, s * 1000 + t, mask=e < n)

    for world, tiles in ((2, 5), (3, 7), (4, 1)):
        for rank in range(world):
            for first in (0, 1):
                o = RankOrderedTiles(world, rank, tiles, first)
                out = torch.zeros(o.num_exec, dtype=torch.int32)
                probe[(1,)](out, o.num_exec, rank, world, tiles, first, BLOCK=32)
                exp = [o.stripe(e) * 1000 + o.local(e) for e in range(o.num_exec)]
                assert out.tolist() == exp, (world, rank, first)
    print("twins ok")


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_twins()
    check_barrier(3)
    check_reduce_scatter(2, 1, 37, 45, 20, 2, False)
    check_reduce_scatter(3, 2, 11, 33, 9, 3, True)
    check_reduce_scatter(2, 1, 37, 45, 20, 2, False, allreduce=True)
    check_reduce_scatter(3, 1, 19, 33, 9, 3, True, allreduce=True)
    check_allgather(2, 1, 21, 35, 18)
    check_allgather(3, 2, 5, 17, 7)
    print("ALL OK")
