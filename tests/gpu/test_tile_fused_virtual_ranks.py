"""tile_fused GEMM + reduce-scatter / all-reduce with W virtual ranks on ONE GPU: the cross-rank
protocol (barrier, tile flags, pushes into peers' receive slots, the reduce, the all-reduce's
gather) under real concurrency, call after call, on a machine with one GPU.

overlap_compile.testing.virtual_ranks: each virtual rank is a host thread with its own streams;
symmetric buffers are W ordinary buffers on the GPU with one address table. What this shows: the
flag protocol pairs the right tiles and slots, no call reads a slot before it is complete or after
the next call overwrote it, and the result is right on every call with the inputs changing from
call to call. What it cannot show: ordering across an NVLink fabric (every "peer" here shares one
L2), which the 2-GPU race loops of tests/gpu/test_tile_fused.py check.
"""
from __future__ import annotations

import pytest
import torch

from overlap_compile.testing.virtual_ranks import virtual_ranks, warm_up_tile_fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VARIANTS = 3  # input sets cycled call after call



def _tally(errs: torch.Tensor, calls: int, dtype: torch.dtype) -> dict:
    """Calls made, calls wrong (relative error over the dtype's tolerance, or NaN), the worst error."""
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    return {"calls": calls, "wrong": int(((errs > tol) | errs.isnan()).sum()), "max_rel": float(errs.max())}


def race(kind: str, m: int | tuple[int, ...], n: int, k: int, world: int, calls: int, dtype: torch.dtype) -> dict:
    """GEMM + reduce-scatter / all-reduce with ``world`` virtual ranks, call after call, inputs
    changing. ``m`` a tuple: the input sets take its row counts in turn (one set of receive
    buffers and flags serves them all, each call starting from the flags the last one left)."""
    from overlap_compile.templates.plans import GemmCollectivePlan
    from overlap_compile.templates.tile_fused import kernels as K

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ms = m if isinstance(m, tuple) else (m,)
    cfg = {"block_m": 128, "block_n": 128, "group_m": 8, "comm_ctas": 8}
    plans = []
    for v in range(VARIANTS):
        mv = ms[v % len(ms)]
        outer, chunk = (1, mv) if kind == "gemm_allreduce" else (1, mv // world)
        plans.append(GemmCollectivePlan("tile_fused", kind, mv, n, k, world, "sum", outer, chunk, False, cfg,
                                        timeout_ms=5000))
    g = torch.Generator(device=dev).manual_seed(7)
    inputs = [[(torch.randn(p.m, k, device=dev, dtype=dtype, generator=g) / 4,
                torch.randn(k, n, device=dev, dtype=dtype, generator=g) / 4) for _ in range(world)]
              for p in plans]
    full = [sum(a.double() @ b.double() for a, b in v) for v in inputs]  # the sum over ranks
    expected = [[f if kind == "gemm_allreduce" else f[r * p.chunk:(r + 1) * p.chunk] for r in range(world)]
                for f, p in zip(full, plans)]
    with virtual_ranks(world, dev) as group:
        # each row count's kernels, and the buffers grown to the largest before any rank runs
        for v in range(min(len(ms), VARIANTS)):
            warm_up_tile_fused(group, [lambda r=r, v=v: K._run_rs(*inputs[v][r], None, "virtual", plans[v])
                                       for r in range(world)])

        def calls_of(r: int) -> torch.Tensor:
            errs = []
            for i in range(calls):
                a, b = inputs[i % VARIANTS][r]
                out = K.run(a, b, None, "virtual", plans[i % VARIANTS])
                exp = expected[i % VARIANTS][r]
                errs.append((out.double() - exp).norm() / exp.norm())
                if not group.pace(i):
                    break
            return torch.stack(errs)

        errs = torch.stack(group.run(calls_of))
        K.check_errors(dev)
    return _tally(errs, calls, dtype)


@pytest.mark.parametrize("kind,m,n,k", [("gemm_reducescatter", 2 * 1000, 1000, 520),
                                        ("gemm_reducescatter", 4096, 4096, 1024),
                                        ("gemm_reducescatter", (2 * 1000, 2 * 700, 2 * 1200), 1000, 520),
                                        ("gemm_allreduce", 2 * 500, 1000, 520),
                                        ("gemm_allreduce", 4096, 4096, 1024),
                                        ("gemm_allreduce", (2 * 1000, 2 * 700, 2 * 1200), 1000, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_call_right_with_two_virtual_ranks(kind, m, n, k, dtype):
    from overlap_compile.templates.tile_fused import kernels as K

    if not K.available():
        pytest.skip("tile_fused kernels unavailable (Triton / sm_80+)")
    from overlap_compile.testing.multiprocess import run_distributed

    # a process of its own: a fresh CUDA context and none of earlier tests' memory
    (r,) = run_distributed(race, world_size=1, args=(kind, m, n, k, 2, 300, dtype), timeout_s=400)
    print(kind, (m, n, k), dtype, r)
    assert r["wrong"] == 0, r


def race_allgather(m: int | tuple[int, ...], n: int, k: int, world: int, calls: int, dtype: torch.dtype) -> dict:
    """All-gather + GEMM with ``world`` virtual ranks, call after call, inputs changing: the call
    start barriers, the staging copy, the peers' chunk pulls and their flags, the GEMM's waits.
    ``m`` a tuple: the input sets take its row counts in turn (one staging buffer serves them all)."""
    from overlap_compile.templates.plans import AllGatherGemmPlan
    from overlap_compile.templates.tile_fused import kernels as K

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ms = m if isinstance(m, tuple) else (m,)
    cfg = {"block_m": 128, "block_n": 128, "group_m": 8, "comm_ctas": 8}
    plans = [AllGatherGemmPlan("tile_fused", ms[v % len(ms)], k, (n,), world, 1, ms[v % len(ms)] // world, (False,),
                               cfg, timeout_ms=5000) for v in range(VARIANTS)]
    g = torch.Generator(device=dev).manual_seed(11)
    inputs = [([torch.randn(p.chunk, k, device=dev, dtype=dtype, generator=g) / 4 for _ in range(world)],
               torch.randn(k, n, device=dev, dtype=dtype, generator=g) / 4) for p in plans]
    expected = [torch.cat(shards).double() @ b.double() for shards, b in inputs]
    with virtual_ranks(world, dev) as group:
        for v in range(min(len(ms), VARIANTS)):  # each row count's kernels (warm-up sets the rank by index)
            warm_up_tile_fused(group, [lambda r=r, v=v: K._run_ag(inputs[v][0][r], [inputs[v][1]], [None], "virtual",
                                                                  plans[v]) for r in range(world)])

        def calls_of(r: int) -> torch.Tensor:
            errs = []
            for i in range(calls):
                shards, b = inputs[i % VARIANTS]
                _, y = K.run_allgather(shards[r], [b], [None], "virtual", plans[i % VARIANTS])
                exp = expected[i % VARIANTS]
                errs.append((y.double() - exp).norm() / exp.norm())
                if not group.pace(i):
                    break
            return torch.stack(errs)

        errs = torch.stack(group.run(calls_of))
        K.check_errors(dev)
    return _tally(errs, calls, dtype)


@pytest.mark.parametrize("m,n,k", [(2 * 1000, 1000, 520), (4096, 4096, 1024), ((2 * 1000, 2 * 700, 2 * 1200), 1000, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_allgather_every_call_right_with_two_virtual_ranks(m, n, k, dtype):
    """Two ranks' persistent GEMMs share one GPU here: a kernel a GEMM waits on that can only
    start once some GEMM leaves the SMs (the call's second barrier, queued behind the GEMM before
    the ranks met ahead of it) shows up as a wait timeout."""
    from overlap_compile.templates.tile_fused import kernels as K

    if not K.available():
        pytest.skip("tile_fused kernels unavailable (Triton / sm_80+)")
    from overlap_compile.testing.multiprocess import run_distributed

    (r,) = run_distributed(race_allgather, world_size=1, args=(m, n, k, 2, 300, dtype), timeout_s=400)
    print("allgather", (m, n, k), dtype, r)
    assert r["wrong"] == 0, r
