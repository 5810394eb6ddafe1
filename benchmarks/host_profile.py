"""Host time of each template's op per call, on W GPUs.

    python benchmarks/host_profile.py --world 2 --out $OUT

Per (kind, template) on a small site (GPU work of microseconds, so the host is what is timed):
the wall time per call of N back-to-back calls of the rewritten graph (host-bound), beside the
sequential pattern's. What a host-launched model pays per rewritten site beyond the GEMM and
collective it replaced; the numbers the predictor's ``op_overhead_ms`` summarises. A cProfile of
these calls puts most of the time in torch's custom-op frame, an artefact of calls through the C++
dispatcher: where the time goes is found by timing each CUDA runtime call an op makes on its own.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

from benchmarks.ops import rewritten  # noqa: E402
from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import host_ms_per_call  # noqa: E402
from overlap_compile.testing.patterns import gemm_then_collective, site_op  # noqa: E402

SHAPE = (1024, 1024, 1024)  # M, N, K: GPU time of tens of microseconds
# per-rank sites of the Llama-3-8B TP+SP block at W=2, seq 8192 (--shapes 8b): the attention
# output and W2 reduce-scatters, the QKV and W1/W3 all-gathers (M, N, K of the GEMM)
LLAMA8B_SITES = {"gemm_reducescatter": [(8192, 4096, 2048), (8192, 4096, 7168)],
                 "allgather_gemm": [(8192, 3072, 4096), (8192, 14336, 4096)],
                 "gemm_allreduce": [(8192, 4096, 7168)], "gemm_alltoall": [(8192, 4096, 2048)]}


def sites(kinds: list[str], shapes: str) -> list[tuple[str, tuple[int, int, int]]]:
    """(kind, M x N x K) to time: the small site, and with ``shapes='8b'`` the Llama-3-8B ones too."""
    out = [(kind, SHAPE) for kind in kinds]
    if shapes == "8b":
        out += [(kind, s) for kind in kinds for s in LLAMA8B_SITES.get(kind, [])]
    return out


def worker(kinds, templates_to_run, calls, out_dir, shapes="small", graph_modes=(True,)):
    from overlap_compile import config
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates import base

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    rows = []
    for kind, (m, n, k) in sites(kinds, shapes):
        full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        a = full[rank * (m // world):(rank + 1) * (m // world)].contiguous() if kind == "allgather_gemm" else full
        seq = gemm_then_collective(kind, group, world)
        entries = [("sequential", lambda: seq(a, b), None, None)]
        for name in templates_to_run:
            if world == 1:  # the pass keeps W=1 sites: the op on its default plan, called directly
                fn, cfg = site_op(kind, name, a, b, group, world), None
            else:
                fn, site = rewritten(kind, name, a, b, group, world)
                cfg = site.config
            if fn is not None:
                entries += [(name, fn, cfg, g) for g in graph_modes]
        # big sites: fewer calls, so the host loop is not throttled by a full launch queue
        n_calls = calls if (m, n, k) == SHAPE else max(10, calls // 10)
        for name, fn, cfg, graphs in entries:
            base.clear_routes()
            op_graphs.clear()
            with config.patch(op_graphs=bool(graphs)):
                ms = host_ms_per_call(fn, n_calls)
            row = {"benchmark": "host_profile", "device": torch.cuda.get_device_name(), "world_size": world,
                   "torch": torch.__version__, "date": datetime.date.today().isoformat(), "kind": kind,
                   "shape": [m, n, k], "method": name, "config": cfg, "op_graphs": graphs,
                   "replayed": op_graphs.stats["replayed"], "host_ms_per_call": ms}
            dist.barrier()
            rows.append(row)
            if rank == 0:
                tag = "" if graphs is None else (" op_graphs" if graphs else " launched")
                print(f"{kind:>20} {str([m, n, k]):>20} {name + tag:>26} host {ms * 1e3:8.1f} us/call "
                      f"({op_graphs.stats['replayed']} replays)", flush=True)
    if rank == 0 and out_dir:
        print("wrote", write_rows(rows, out_dir, "host_profile", torch.cuda.get_device_name(), world))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kinds", default="gemm_reducescatter,allgather_gemm,gemm_allreduce,gemm_alltoall")
    ap.add_argument("--templates", default="p2p_ring,priority_stream,signal_reorder",
                    help="templates forced on every kind (tile_fused: name it with --kinds allgather_gemm)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--shapes", default="small", choices=("small", "8b"),
                    help="small: the 1024^3 site; 8b: also the Llama-3-8B block's sites")
    ap.add_argument("--op-graphs", default="on,off",
                    help="template ops replayed from per-site CUDA graphs (on), launched piece by piece (off), or both")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_profile times CUDA ops: it needs GPUs")
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=args.world,
                    args=(args.kinds.split(","), args.templates.split(","), args.calls, args.out, args.shapes,
                          tuple(v == "on" for v in args.op_graphs.split(","))),
                    backend="nccl", timeout_s=600)


if __name__ == "__main__":
    main()
