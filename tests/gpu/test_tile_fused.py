"""tile_fused's GPU path (kernels.py) on W GPUs over NCCL + torch symmetric memory, against
torch.mm + the NCCL collective: odd shapes, 100 calls back to back (no synchronisation between
them, so a race between calls shows up as a wrong result), eager and replayed from a CUDA graph
(outputs poisoned with NaN before every replay). Also: a wait that can never be satisfied raises
TileWaitTimeout naming what it waited on.

    python tests/gpu/test_tile_fused.py bench     # timing vs torch.mm + NCCL (eager, CUDA graph)
"""
from __future__ import annotations

import statistics
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs (none visible)"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _setup():
    import torch.distributed as dist

    from overlap_compile import templates
    from overlap_compile.templates.tile_fused import kernels as K

    templates.load_all_ops()
    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD.group_name
    why = K.usable(group, dev)
    if why is not None:
        raise RuntimeError(f"tile_fused kernels not usable here: {why}")
    return dist, K, dev, group, rank, dist.get_world_size()


def _make(kind, m, n, k, outer, world, dev, dtype, bias, comm_ctas=8, bm=128, bn=128, ns2=None):
    from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan
    from overlap_compile.tiling import RowStripes

    st = RowStripes(outer, world, m // (outer * world))
    cfg = {"block_m": bm, "block_n": bn, "group_m": 8, "comm_ctas": comm_ctas}
    g = torch.Generator(device=dev).manual_seed(1 + torch.distributed.get_rank())
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g) / 4  # noqa: E731
    if kind in ("gemm_reducescatter", "gemm_allreduce"):
        a, b = rnd(m, k), rnd(k, n)
        bvec = rnd(n) if bias else None
        outer, chunk = (1, m) if kind == "gemm_allreduce" else (st.outer, st.chunk)  # the finder's AR plan
        plan = GemmCollectivePlan("tile_fused", kind, m, n, k, world, "sum", outer, chunk, bias, cfg)
        return st, plan, (a, b, bvec)
    ns = (n,) + ((ns2,) if ns2 else ())
    shard = rnd(st.stripe_rows, k)
    bs = [rnd(k, x) for x in ns]
    biases = [rnd(x) if bias else None for x in ns]
    plan = AllGatherGemmPlan("tile_fused", m, k, ns, world, st.outer, st.chunk, tuple(bias for _ in ns), cfg)
    return st, plan, (shard, bs, biases)


def _sequential(dist, kind, st, args, world):
    """torch.mm + the NCCL collective, as the original graph runs it."""
    if kind == "gemm_allreduce":
        a, b, bias = args
        full = torch.addmm(bias, a, b) if bias is not None else a @ b
        dist.all_reduce(full)
        return [full]
    if kind == "gemm_reducescatter":
        a, b, bias = args
        full = torch.addmm(bias, a, b) if bias is not None else a @ b
        send = torch.cat([st.stripe(full, j) for j in range(world)]) if st.outer > 1 else full
        out = torch.empty(st.stripe_rows, full.shape[1], dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(out, send)
        return [out]
    shard, bs, biases = args
    gath = torch.empty(world * shard.shape[0], shard.shape[1], dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(gath, shard)
    if st.outer > 1:
        g2 = torch.empty_like(gath)
        for j in range(world):
            st.place(g2, j, gath[j * st.stripe_rows:(j + 1) * st.stripe_rows])
        gath = g2
    return [gath] + [torch.addmm(bi, gath, b) if bi is not None else gath @ b for b, bi in zip(bs, biases)]


def _op(kind, group, plan, args):
    ops = torch.ops.overlap_compile
    if kind in ("gemm_reducescatter", "gemm_allreduce"):
        return lambda: [ops.tile_fused_gemm_collective(*args, group, plan.to_json())]
    return lambda: list(ops.tile_fused_allgather_gemm(*args, group, plan.to_json()))


def _rel(got, exp):
    return (got.double() - exp.double()).norm() / exp.double().norm().clamp_min(1e-30)


def check_cases(cases: list[dict], iters: int) -> list[tuple]:
    dist, K, dev, group, rank, world = _setup()
    torch.cuda.set_device(dev)
    rows = []
    for c in cases:
        dtype = getattr(torch, c.get("dtype", "bfloat16"))
        st, plan, args = _make(c["kind"], c["m"], c["n"], c["k"], c.get("outer", 1), world, dev, dtype,
                               c.get("bias", False), c.get("comm_ctas", 8), c.get("bm", 128), c.get("bn", 128),
                               c.get("n2"))
        exp = _sequential(dist, c["kind"], st, args, world)
        fn = _op(c["kind"], group, plan, args)
        errs = []
        for _ in range(iters):  # back to back: no sync between calls
            errs += [_rel(g, e) for g, e in zip(fn(), exp)]
        eager = float(torch.stack(errs).max())
        K.check_errors(dev)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn()
        errs = []
        for _ in range(iters):
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            errs += [_rel(g, e) for g, e in zip(outs, exp)]
        replay = float(torch.stack(errs).max())
        K.check_errors(dev)
        rows.append((c, eager, replay))
        dist.barrier()
    return rows


def _cases():
    return [
        dict(kind="gemm_reducescatter", m=2 * 1000, n=1000, k=520, bias=True),            # odd tiles
        # other M at the same N: the receive buffer and its flags grow to the larger, then the
        # smaller M uses their start (the flags as the larger M's calls left them)
        dict(kind="gemm_reducescatter", m=2 * 1200, n=1000, k=520),
        dict(kind="gemm_reducescatter", m=2 * 700, n=1000, k=520),
        dict(kind="gemm_reducescatter", m=4096, n=4096, k=1024, bn=256),
        dict(kind="gemm_reducescatter", m=2 * 3 * 136, n=392, k=200, outer=3, bm=64, bn=64),  # dim-1 scatter
        dict(kind="gemm_allreduce", m=4 * 500, n=1000, k=520, bias=True),               # odd tiles, W=2 and 4
        dict(kind="gemm_allreduce", m=4 * 600, n=1000, k=520),                          # grows, as above
        dict(kind="gemm_allreduce", m=4 * 350, n=1000, k=520),
        dict(kind="gemm_allreduce", m=4096, n=4096, k=1024, bn=256),
        dict(kind="allgather_gemm", m=2 * 1000, n=1000, k=520, bias=True, n2=300),
        # other M at the same K: the shard's buffer grows to the larger, then the smaller M uses its start
        dict(kind="allgather_gemm", m=2 * 1200, n=1000, k=520),
        dict(kind="allgather_gemm", m=2 * 700, n=1000, k=520),
        dict(kind="allgather_gemm", m=4096, n=4096, k=1024, bn=256),
        dict(kind="allgather_gemm", m=2 * 3 * 136, n=392, k=200, outer=3, bm=64, bn=64),
    ]


@pytest.mark.parametrize("kind", ["allgather_gemm", "gemm_reducescatter", "gemm_allreduce"])
@pytest.mark.parametrize("world", [2, 4])
def test_against_mm_and_nccl(world, kind):
    from overlap_compile.testing.multiprocess import run_distributed

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    cases = [c for c in _cases() if c["m"] % (world * c.get("outer", 1)) == 0 and c["kind"] == kind]
    for rank_rows in run_distributed(check_cases, world_size=world, args=(cases, 100), backend="nccl",
                                     timeout_s=600):
        for c, eager, replay in rank_rows:
            print(f"W={world} {c}: eager {eager:.2e} graph {replay:.2e}")
            assert eager <= TOL[torch.bfloat16] and replay <= TOL[torch.bfloat16], (c, eager, replay)


# ---- race loops: many calls back to back, the inputs changing every call ------------------------

RACE_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}
RACE_VARIANTS = 3  # input sets cycled call after call: a tile left over from the last call shows


def race_cases(cases: list[dict], calls: int) -> list[dict]:
    """Per case: ``calls`` host-launched calls back to back (no synchronisation), then ``calls``
    CUDA-graph replays (one graph per input set, outputs poisoned with NaN before each replay),
    each call's every output compared with torch.mm + NCCL on that call's inputs. Counts the wrong
    calls; the comparison runs on the GPU behind the calls so nothing slows them down."""
    dist, K, dev, group, rank, world = _setup()
    torch.cuda.set_device(dev)
    out = []
    for c in cases:
        dtype = getattr(torch, c.get("dtype", "bfloat16"))
        tol = RACE_TOL[dtype]
        sets = []
        for v in range(RACE_VARIANTS):
            st, plan, args = _make(c["kind"], c["m"], c["n"], c["k"], c.get("outer", 1), world, dev, dtype,
                                   c.get("bias", False), c.get("comm_ctas", 8), c.get("bm", 128), c.get("bn", 128),
                                   c.get("n2"))
            args = _reseed(args, v, rank)
            sets.append((_op(c["kind"], group, plan, args), _sequential(dist, c["kind"], st, args, world)))
        torch.cuda.synchronize()
        dist.barrier()
        errs = []
        for i in range(calls):
            fn, exp = sets[i % RACE_VARIANTS]
            errs.append(torch.stack([_rel(g, e) for g, e in zip(fn(), exp)]).max())
        eager = torch.stack(errs)
        K.check_errors(dev)
        torch.cuda.synchronize()
        dist.barrier()
        graphs = []
        for fn, exp in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = fn()
            graphs.append((g, outs, exp))
        errs = []
        for i in range(calls):
            g, outs, exp = graphs[i % RACE_VARIANTS]
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            errs.append(torch.stack([_rel(o, e) for o, e in zip(outs, exp)]).max())
        replay = torch.stack(errs)
        K.check_errors(dev)
        bad = lambda e: int(((e > tol) | e.isnan()).sum())  # noqa: E731
        out.append({"case": c, "calls": calls, "wrong_eager": bad(eager), "wrong_graph": bad(replay),
                    "max_eager": float(eager.nan_to_num(float("inf")).max()),
                    "max_graph": float(replay.nan_to_num(float("inf")).max())})
        dist.barrier()
    return out


def _reseed(args, v: int, rank: int):
    """Input set ``v`` of a case: the activations differ between sets (weights too), so that
    consecutive calls must not agree by accident."""
    g = torch.Generator(device=args[0].device).manual_seed(1000 * (v + 1) + rank)

    def fresh(t):
        return None if t is None else torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype) / 4

    if isinstance(args[1], list):
        shard, bs, biases = args
        return fresh(shard), [fresh(b) for b in bs], [fresh(b) for b in biases]
    return tuple(fresh(t) for t in args)


def _race_cases_for(kind: str, world: int) -> list[dict]:
    cases = []
    for c in _cases():
        if c["kind"] != kind or c["m"] % (world * c.get("outer", 1)):
            continue
        for dtype in ("bfloat16", "float16", "float32"):
            cases.append({**c, "dtype": dtype})
    return cases


@pytest.mark.parametrize("kind", ["gemm_reducescatter", "gemm_allreduce", "allgather_gemm"])
@pytest.mark.parametrize("world", [2, 4])
def test_race_loop_every_call_right(world, kind):
    """1,000 calls per case and launch mode, varying inputs, bf16/fp16/fp32: zero wrong calls."""
    from overlap_compile.testing.multiprocess import run_distributed

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    cases = _race_cases_for(kind, world)
    results = run_distributed(race_cases, world_size=world, args=(cases, 1000), backend="nccl", timeout_s=900)
    wrong = []
    for rank, rows in enumerate(results):
        for r in rows:
            print(f"W={world} rank {rank} {r['case']}: {r['calls']} calls, wrong eager {r['wrong_eager']} "
                  f"(max rel {r['max_eager']:.2e}), wrong graph {r['wrong_graph']} (max rel {r['max_graph']:.2e})")
            if r["wrong_eager"] or r["wrong_graph"]:
                wrong.append((rank, r))
    assert not wrong, wrong


def test_wait_timeout_raises():
    from overlap_compile.runtime.spin_wait import bound_us
    from overlap_compile.templates.tile_fused import kernels as K

    if not K.available():
        pytest.skip("tile_fused kernels unavailable (Triton / sm_80+)")
    dev = torch.device("cuda", 0)
    flags = torch.zeros(4, dtype=torch.int32, device=dev)
    K._launch_small("wait", K._wait_kernel, (1,), flags, 2, 1, K._err_buf(dev), bound_us(50), 50_000, num_warps=1)
    with pytest.raises(K.TileWaitTimeout, match=r"tile_fused .*rank 2 timed out: its flag read 0, expected >= 1"):
        K.check_errors(dev)
    K.check_errors(dev)  # the record was cleared


# ---- timing -----------------------------------------------------------------------------------------

def _time(fn, iters, graph):
    import torch.distributed as dist

    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(3):
        run()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            run()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


def bench_worker(shapes: list[tuple], iters: int) -> list[str]:
    dist, K, dev, group, rank, world = _setup()
    torch.cuda.set_device(dev)
    lines = []
    for kind, m, n, k, bm, bn, ctas in shapes:
        st, plan, args = _make(kind, m, n, k, 1, world, dev, torch.bfloat16, False, ctas, bm, bn)
        fn = _op(kind, group, plan, args)
        fn()  # compile + allocate before any capture
        seq = lambda: _sequential(dist, kind, st, args, world)  # noqa: E731
        seq()
        for graph in (False, True):
            t_seq = _time(seq, iters, graph)
            t_tf = _time(fn, iters, graph)
            lines.append(f"{kind:20s} m={m} n={n} k={k} tiles={bm}x{bn} comm_ctas={ctas} "
                         f"{'cuda_graph' if graph else 'eager':10s} seq {t_seq:.3f} ms  tile_fused {t_tf:.3f} ms  "
                         f"speedup {t_seq / t_tf:.2f}x")
        K.check_errors(dev)
    lines.append(f"paths: comm kernels asm={K._use_asm} gemm variants={list(K._fallbacks.values())} "
                 f"notify={'stream memop' if K._stream_driver() is not None else 'kernel'}")
    return lines


def bench(world: int = 2) -> None:
    from overlap_compile.testing.multiprocess import run_distributed

    shapes = [
        ("gemm_reducescatter", 8192, 8192, 4096, 128, 256, 8),
        ("gemm_reducescatter", 8192, 8192, 4096, 128, 256, 16),
        ("gemm_reducescatter", 4096, 4096, 4096, 128, 256, 8),
        ("allgather_gemm", 8192, 8192, 4096, 128, 256, 8),
        ("allgather_gemm", 4096, 4096, 4096, 128, 256, 8),
    ]
    for line in run_distributed(bench_worker, world_size=world, args=(shapes, 10), backend="nccl",
                                timeout_s=300)[0]:
        print(line, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        bench(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
