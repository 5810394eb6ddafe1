"""Where does signal_reorder's time go? One shape per kind, every piece timed alone (CUDA graph).

    python benchmarks/signal_reorder_breakdown.py --world 4 --out $OUT

Pieces: cuBLAS mm; the Triton GEMM at P programs; the GEMM with the signalling epilogue (no
waits); the collective on the whole buffer and split into G group calls back to back; the full
op at (P, G, waiter). Comparing them separates GEMM speed, epilogue cost, fragmentation of the
collective, waiter cost and contention.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ops import graphed, time_ms  # noqa: E402

from overlap_compile.templates.plans import GemmCollectivePlan  # noqa: E402
from overlap_compile.tiling import TileGrid, cdiv, even_wave_groups  # noqa: E402

c10d = torch.ops._c10d_functional


def plan_for(kind, m, n, k, world, programs, groups, bm=128, bn=256):
    stripes = 1 if kind == "gemm_allreduce" else world
    rows = m if stripes == 1 else m // world
    tiles = TileGrid(rows, n, bm, bn, 8).num_tiles * stripes
    programs = programs // stripes * stripes
    waves = cdiv(tiles, programs)
    cfg = {"block_m": bm, "block_n": bn, "group_m": 8, "programs": programs,
           "wave_groups": list(even_wave_groups(waves, groups))}
    return GemmCollectivePlan(template="signal_reorder", kind=kind, m=m, n=n, k=k, world=world, reduce_op="sum",
                              outer=1, chunk=m // world if stripes > 1 else m, has_bias=False, config=cfg)


def collective(kind, t, group, world):
    if kind == "gemm_allreduce":
        return c10d.wait_tensor(c10d.all_reduce(t, "sum", group))
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "sum", world, group))


def worker(cases, out_dir):
    from overlap_compile.templates.signal_reorder import kernels

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.group_name
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def rec(name, kind, shape, ms, **kw):
        rows.append({"benchmark": "breakdown", "device": torch.cuda.get_device_name(), "world_size": world,
                     "torch": torch.__version__, "date": datetime.date.today().isoformat(), "kind": kind,
                     "shape": shape, "method": name, "mode": "cuda_graph", "ms": ms, **kw})
        if rank == 0:
            print(f"{kind:>20} {str(shape):>20} {name:>40} {ms:8.3f} ms", flush=True)

    for kind, (m, n, k) in cases:
        torch.manual_seed(rank)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k**0.25
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.25
        y = a @ b
        shape = [m, n, k]
        rec("cublas_mm", kind, shape, time_ms(graphed(lambda: a @ b)))
        for p in (sms, sms - 24):
            rec(f"triton_gemm_P{p}", kind, shape, time_ms(graphed(lambda: kernels.gemm(a, b, programs=p))))
        rec("collective_whole", kind, shape, time_ms(graphed(lambda: collective(kind, y, group, world))))
        for g in (2, 4, 8):
            flat = y.view(-1)
            # split the same way the template does: equal slices (AR), or per-rank-equal (RS)
            parts = flat.chunk(g) if kind == "gemm_allreduce" else [y.view(world, -1)[:, i::g].contiguous().view(-1) for i in range(g)]
            rec(f"collective_{g}_calls", kind, shape, time_ms(graphed(lambda: [collective(kind, t, group, world) for t in parts])))
        for p in (sms, sms - 24):
            for g in (1, 2, 4, 6):
                plan = plan_for(kind, m, n, k, world, p, g)
                send, cnt = kernels.gemm_signal_into(a, b, None, plan)
                if g == 1:
                    rec(f"gemm_signal_only_P{plan.config['programs']}", kind, shape,
                        time_ms(graphed(lambda: (kernels.gemm_signal_into(a, b, None, plan, send=send, counters=cnt), cnt.zero_()))))
                for mode in ("spin", "stream"):
                    os.environ["OVERLAP_COMPILE_SIGNAL_WAIT"] = mode
                    try:
                        ms = time_ms(graphed(lambda: kernels.run(a, b, None, group, plan)))
                    except Exception as e:
                        ms = float("nan")
                        if rank == 0:
                            print(f"  {mode} P{p} G{g}: {type(e).__name__}: {str(e)[:200]}")
                    rec(f"op_P{plan.config['programs']}_G{len(plan.config['wave_groups'])}_{mode}", kind, shape, ms,
                        config=plan.config)
        os.environ.pop("OVERLAP_COMPILE_SIGNAL_WAIT", None)
    if rank == 0 and out_dir:
        path = os.path.join(out_dir, f"breakdown-{torch.cuda.get_device_name().replace(' ', '_')}-w{world}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    cases = [("gemm_allreduce", (8192, 8192, 4096)), ("gemm_reducescatter", (8192, 8192, 7168))]
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=args.world, args=(cases, args.out), backend="nccl", timeout_s=500)


if __name__ == "__main__":
    main()
