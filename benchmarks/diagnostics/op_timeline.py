"""Where one rewritten site's time goes on the GPU, kernel by kernel and stream by stream: each
method's call captured in a CUDA graph (as ops.py's cuda_graph rows time it) and one replay
profiled with torch.profiler, on W GPUs.

    python benchmarks/diagnostics/op_timeline.py --kind allgather_gemm --shape 4096,2048,8192 \\
        --methods sequential,auto,p2p_ring,tile_fused,async_tp --out $OUT

Per method, rank 0 prints every GPU activity of the replay (kernels, copies, memsets) with its
stream, start and duration in microseconds from the replay's first activity, and the span; every
rank writes its rows to op_timeline-<device>-w<W>-torch<v>-<date>.json under --out (rank in
each row). Methods are ops.py's (a template name, NAME@key=value, auto, async_tp) plus
``sequential``: what the gaps, waits and copies around the GEMMs cost is read off here, not
guessed from the totals.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

from benchmarks import ops  # noqa: E402
from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import graphed, time_ms  # noqa: E402
from overlap_compile.testing.patterns import gemm_then_collective  # noqa: E402

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def method_fn(name: str, kind: str, a, b, group: str, world: int):
    """(fn, what ran): the callable ops.py would time for ``name`` on this site."""
    from torch._inductor import config as ic

    if name == "sequential":
        seq = gemm_then_collective(kind, group, world)
        return (lambda: seq(a, b)), "sequential"
    # "auto" decides as for a captured graph, as ops.py's cuda_graph rows; the rest as ops.py
    # builds them (async-TP's compile must not capture graphs of its own)
    with ic.patch({"triton.cudagraphs": name == "auto"}):
        fn, config, _, _ = ops._site(name, kind, a, b, group, world)
    return fn, str(config)


ALIGN = "AllReduce_Sum_f64"  # the all-reduce that lines the ranks' streams up before the replay


def activities(prof) -> list[dict]:
    """GPU activities of a profile after the aligning all-reduce, start-sorted, times in us from
    the first one."""
    evs = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    align = [i for i, e in enumerate(evs) if ALIGN in e.name]
    evs = evs[align[0] + 1:] if align else evs
    rows = [{"name": e.name, "stream": getattr(e, "device_resource_id", -1), "start": e.time_range.start,
             "dur": e.time_range.end - e.time_range.start} for e in evs]
    rows.sort(key=lambda r: r["start"])
    t0 = rows[0]["start"] if rows else 0
    for r in rows:
        r["start"] -= t0
    return rows


def profile_replay(fn) -> list[dict]:
    replay = graphed(fn)
    time_ms(replay, iters=5)  # warm: every rank has replayed before the profiled one
    token = torch.ones(1, dtype=torch.float64, device="cuda")
    dist.barrier()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        # the replay queued behind an all-reduce: both ranks start it as that ends, within
        # microseconds (a host barrier alone leaves the ranks' profilers and launches apart)
        dist.all_reduce(token)
        replay()
        torch.cuda.synchronize()
    return activities(prof)


def worker(kind: str, shape: list[int], methods: list[str], out: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    m, n, k = shape
    torch.manual_seed(rank)
    full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k**0.25
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.25
    a = full[rank * (m // world):(rank + 1) * (m // world)].contiguous() if kind == "allgather_gemm" else full
    base = {"benchmark": "op_timeline", "device": torch.cuda.get_device_name(), "world_size": world,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "kind": kind, "shape": shape,
            "rank": rank}
    rows = []
    for name in methods:
        try:
            ctx = ops._method_context(name, group)
            with ctx:
                fn, what = method_fn(name, kind, a, b, group, world)
                if fn is None:
                    continue
                acts = profile_replay(fn)
        except Exception as e:  # one method failing must not hide the others
            if rank == 0:
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
            continue
        span = max((r["start"] + r["dur"] for r in acts), default=0.0)
        rows.append({**base, "method": name, "config": what, "span_us": span, "activities": acts})
        if rank == 0:
            print(f"== {name} {kind} {shape}: {what}; span {span:.1f} us, {len(acts)} activities", flush=True)
            for r in acts:
                print(f"  s{r['stream']:<3} {r['start']:8.1f} +{r['dur']:7.1f}  {r['name'][:90]}")
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0 and out:
        print("wrote", write_rows([r for per in gathered for r in per], out, "op_timeline", base["device"], world,
                                 suffix=f"-{kind}-{'x'.join(map(str, shape))}"))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kind", default="allgather_gemm")
    ap.add_argument("--shape", default="4096,2048,8192", help="M,N,K of the site (ops.py's convention)")
    ap.add_argument("--methods", default="sequential,auto,async_tp")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("op_timeline profiles GPU kernels: it needs CUDA GPUs")
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=args.world, backend="nccl", timeout_s=900,
                    args=(args.kind, [int(x) for x in args.shape.split(",")], args.methods.split(","), args.out))


if __name__ == "__main__":
    main()
