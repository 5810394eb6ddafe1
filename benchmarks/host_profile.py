"""Host time of each template's op per call, on W GPUs.

    python benchmarks/host_profile.py --world 2 --out $OUT

Per (kind, template) on a small site (GPU work of microseconds, so the host is what is timed):
the wall time per call of N back-to-back calls of the rewritten graph (host-bound), beside the
sequential pattern's. What a host-launched model pays per rewritten site beyond the GEMM and
collective it replaced; the numbers the predictor's ``op_overhead_ms`` summarises. Where the time
goes (the cost of each CUDA runtime call an op makes) is benchmarks/op_host_probe.py's job: a
cProfile here put most of it in torch's custom-op frame, an artefact of calls through the C++
dispatcher (2x H200, 2026-11-23).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ops import rewritten  # noqa: E402
from overlap_compile.testing.patterns import gemm_then_collective  # noqa: E402

SHAPE = (1024, 1024, 1024)  # M, N, K: GPU time of tens of microseconds


def host_ms_per_call(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls  # the loop's own time: host-side only
    torch.cuda.synchronize()
    return host


def worker(kinds, templates_to_run, calls, out_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    m, n, k = SHAPE
    torch.manual_seed(rank)
    rows = []
    for kind in kinds:
        full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        a = full[rank * (m // world):(rank + 1) * (m // world)].contiguous() if kind == "allgather_gemm" else full
        seq = gemm_then_collective(kind, group, world)
        entries = [("sequential", lambda: seq(a, b), None)]
        for name in templates_to_run:
            fn, site = rewritten(kind, name, a, b, group, world)
            if fn is not None:
                entries.append((name, fn, site.config))
        for name, fn, cfg in entries:
            ms = host_ms_per_call(fn, calls)
            row = {"benchmark": "host_profile", "device": torch.cuda.get_device_name(), "world_size": world,
                   "torch": torch.__version__, "date": datetime.date.today().isoformat(), "kind": kind,
                   "shape": list(SHAPE), "method": name, "config": cfg, "host_ms_per_call": ms}
            dist.barrier()
            rows.append(row)
            if rank == 0:
                print(f"{kind:>20} {name:>16} host {ms * 1e3:8.1f} us/call", flush=True)
    if rank == 0 and out_dir:
        path = os.path.join(out_dir, f"host_profile-{torch.cuda.get_device_name().replace(' ', '_')}-w{world}-"
                                     f"{datetime.date.today().isoformat()}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kinds", default="gemm_reducescatter,allgather_gemm,gemm_allreduce,gemm_alltoall")
    ap.add_argument("--templates", default="p2p_ring,priority_stream,signal_reorder",
                    help="templates forced on every kind (tile_fused: name it with --kinds allgather_gemm)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_profile times CUDA ops: it needs GPUs")
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=args.world,
                    args=(args.kinds.split(","), args.templates.split(","), args.calls, args.out),
                    backend="nccl", timeout_s=600)


if __name__ == "__main__":
    main()
