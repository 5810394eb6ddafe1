"""tile_fused all-gather + GEMM on W GPUs: the race loop of tests/gpu/test_tile_fused.py in three
launch modes, with the flags printed call by call where a call goes wrong.

    torchrun --nproc-per-node 2 benchmarks/diagnostics/tile_fused_allgather_check.py [--calls 1000] [--limit-s 420]

Modes: "direct" (kernels.run_allgather, host-launched, no op graphs), "op" (the custom op, whose
host-launched calls replay from runtime.op_graphs' captured graphs), "cuda_graph" (the op inside
torch.cuda.graph, replayed). Each case cycles three input sets and compares every call with NCCL
all_gather + torch.mm. On a wrong call or a TileWaitTimeout the case runs again call by call with
a synchronisation after each and prints the chunk flags, the barrier flags and the error record.
A watchdog prints the state and exits the process (code 3) past ``--limit-s``: nothing hangs.
Prints one "RESULT" line per rank; exit 0 when every call of every mode was right.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

CASES = [  # tests/gpu/test_tile_fused.py's all-gather cases
    dict(m=2 * 1000, n=1000, k=520, bias=True, n2=300, bm=128, bn=128),
    dict(m=4096, n=4096, k=1024, bias=False, n2=None, bm=128, bn=256),
    dict(m=2 * 3 * 136, n=392, k=200, bias=False, n2=None, bm=64, bn=64, outer=3),
    dict(m=2 * 1024 + 2 * 8, n=4096, k=4096, bias=False, n2=None, bm=128, bn=256),  # all SMs, Llama-like K
]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


def _watchdog(limit_s: float, rank: int) -> None:
    def fire() -> None:
        print(f"[rank {rank}] WATCHDOG: past {limit_s:.0f}s; state follows, then exit 3", flush=True)
        try:
            _print_flags(rank, "watchdog", sync=False)
        finally:
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)

    t = threading.Timer(limit_s, fire)
    t.daemon = True
    t.start()


def _print_flags(rank: int, label: str, sync: bool = True) -> None:
    from overlap_compile.templates.tile_fused import kernels as K

    if sync:
        torch.cuda.synchronize()
    local = {str(k): v.tolist() for k, v in K._local.items() if k and k[0] == "ag"} if sync else "(not read: no sync)"
    barrier = [v.local.tolist() for key, v in _symm_cache().items() if "tile_fused/barrier" in key[1]] if sync else "-"
    err = K._err_buf(torch.device("cuda", torch.cuda.current_device())).tolist() if sync else "-"
    print(f"[rank {rank}] {label}: chunk flags {local} barrier flags {barrier} error record {err}", flush=True)


def _symm_cache() -> dict:
    from overlap_compile.runtime import symm

    return dict(symm._cache)


def _case(c: dict, dtype: torch.dtype, world: int, rank: int, dev: torch.device, group: str):
    from overlap_compile.templates.plans import AllGatherGemmPlan
    from overlap_compile.tiling import RowStripes

    outer = c.get("outer", 1)
    st = RowStripes(outer, world, c["m"] // (outer * world))
    ns = (c["n"],) + ((c["n2"],) if c["n2"] else ())
    cfg = {"block_m": c["bm"], "block_n": c["bn"], "group_m": 8, "comm_ctas": 8}
    plan = AllGatherGemmPlan("tile_fused", c["m"], c["k"], ns, world, st.outer, st.chunk,
                             tuple(c["bias"] for _ in ns), cfg, timeout_ms=5000)
    sets = []
    for v in range(3):
        g = torch.Generator(device=dev).manual_seed(1000 * (v + 1) + rank)
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g) / 4  # noqa: E731
        shard = rnd(st.stripe_rows, c["k"])
        bs = [rnd(c["k"], n) for n in ns]
        biases = [rnd(n) if c["bias"] else None for n in ns]
        gath = torch.empty(world * st.stripe_rows, c["k"], dtype=dtype, device=dev)
        dist.all_gather_into_tensor(gath, shard)
        if outer > 1:
            g2 = torch.empty_like(gath)
            for j in range(world):
                st.place(g2, j, gath[j * st.stripe_rows:(j + 1) * st.stripe_rows])
            gath = g2
        exp = [gath] + [torch.addmm(bi, gath, b) if bi is not None else gath @ b for b, bi in zip(bs, biases)]
        sets.append(((shard, bs, biases), exp))
    return plan, sets


def _rel(got, exp):
    return ((got.double() - exp.double()).norm() / exp.double().norm().clamp_min(1e-30)).reshape(1)


def _run_mode(mode: str, plan, sets, group: str, calls: int, trace: bool, rank: int, tol: float) -> dict:
    from overlap_compile.templates.tile_fused import kernels as K

    def direct(args):
        return lambda: K.run_allgather(*args, group, plan)

    def op(args):
        return lambda: list(torch.ops.overlap_compile.tile_fused_allgather_gemm(*args, group, plan.to_json()))

    make = direct if mode == "direct" else op
    fns = [(make(args), exp) for args, exp in sets]
    if mode == "cuda_graph":
        captured = []
        for fn, exp in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = fn()
            captured.append((g, outs, exp))

        def call(i):
            g, outs, exp = captured[i % 3]
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            return outs, exp
    else:
        def call(i):
            fn, exp = fns[i % 3]
            return fn(), exp
    torch.cuda.synchronize()
    dist.barrier()
    errs, wrong_calls, error = [], [], None
    start = time.monotonic()
    try:
        for i in range(calls):
            outs, exp = call(i)
            errs.append(torch.cat([_rel(o, e) for o, e in zip(outs, exp)]).max().reshape(1))
            if trace:
                torch.cuda.synchronize()
                e = float(errs[-1])
                if not e <= tol:
                    wrong_calls.append(i)
                    if len(wrong_calls) <= 5:
                        _print_flags(rank, f"{mode} call {i} wrong (rel {e:.2e})")
                K.check_errors()
        K.check_errors()
    except K.TileWaitTimeout as e:
        error = str(e)
        _print_flags(rank, f"{mode} after the timeout")
        K.check_errors()  # clear a second record, if any
    e = torch.cat(errs) if errs else torch.zeros(1)
    bad = ((e > tol) | e.isnan())
    return {"mode": mode, "calls": len(errs), "wrong": int(bad.sum()), "first_wrong": int(bad.nonzero()[0]) if bad.any() else None,
            "max_rel": float(e.nan_to_num(float("inf")).max()), "timeout": error,
            "ms_per_call": (time.monotonic() - start) * 1e3 / max(1, len(errs)), "traced_wrong": wrong_calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--limit-s", type=float, default=420.0, help="watchdog: exit 3 past this")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--modes", default="direct,op,cuda_graph")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    _watchdog(args.limit_s, rank)
    dist.init_process_group("nccl", device_id=dev)
    from overlap_compile import templates
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates.tile_fused import kernels as K

    templates.load_all_ops()
    group = dist.group.WORLD.group_name
    why = K.usable(group, dev)
    if why is not None:
        raise SystemExit(f"tile_fused kernels not usable here: {why}")
    failed = 0
    for c in CASES:
        if c["m"] % (world * c.get("outer", 1)):
            continue
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            plan, sets = _case(c, dtype, world, rank, dev, group)
            for mode in args.modes.split(","):
                r = _run_mode(mode, plan, sets, group, args.calls, False, rank, TOL[dtype])
                if r["wrong"] or r["timeout"]:
                    failed += 1
                    print(f"[rank {rank}] FAIL {c} {dname} {r}; again call by call:", flush=True)
                    dist.barrier()
                    r2 = _run_mode(mode, plan, sets, group, min(args.calls, 200), True, rank, TOL[dtype])
                    print(f"[rank {rank}] traced {r2}", flush=True)
                elif rank == 0:
                    print(f"ok {c['m']}x{c['n']}x{c['k']} {dname} {mode}: {r['calls']} calls, max rel {r['max_rel']:.1e}, "
                          f"{r['ms_per_call']:.2f} ms/call", flush=True)
                dist.barrier()
    from overlap_compile.templates.tile_fused import launch

    print(f"RESULT rank {rank}: {'PASS' if not failed else f'FAIL ({failed} case-modes)'}; notify={launch.notify_path()} "
          f"comm kernels asm={K._use_asm} gemm variants={sorted(set(map(str, K._fallbacks.values())))} "
          f"op_graphs={dict(op_graphs.stats)} free SMs={K.AG_FREE_SMS}", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    from overlap_compile.runtime import teardown
    teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
