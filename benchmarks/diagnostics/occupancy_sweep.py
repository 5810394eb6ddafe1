"""priority_stream's occupancy-shaping sweep (resource-aware overlap): one GEMM -> collective
site, the op with ``--chunks`` chunks, its GEMM on cuBLAS or on the persistent Triton GEMM at each
(tile, pipeline stages, persistent programs), the communication stream at the highest priority
or at the default one. Each row is timed beside the sequential baseline and the same GEMM alone.

    python benchmarks/diagnostics/occupancy_sweep.py --world 2 --out DIR            # GPUs (NCCL)
    python benchmarks/diagnostics/occupancy_sweep.py --dry-run --out DIR            # CPU plumbing check (gloo)

Fewer stages -> less shared memory per GEMM block -> NCCL's blocks can sit on the same SMs;
fewer programs -> whole SMs left to NCCL. Both slow the GEMM alone and can speed the overlap up:
the sweep shows where the two meet on this machine. Rows follow DESIGN.md's schema
(``method`` priority_stream, ``config`` the template config plus ``priority``) and go to
<out>/occupancy-<device>-w<W>-torch<v>-<date>.json (benchmarks/results_io.py) with a PNG (speedup vs
programs, one line per tile/stages and priority: benchmarks/plot.py's plot_occupancy) and a printed
table with ratios over sequential.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

from benchmarks.plot import plot_occupancy  # noqa: E402
from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import graphed, time_ms  # noqa: E402
from overlap_compile.testing.patterns import gemm_then_collective  # noqa: E402

TILES = [(128, 256, 3), (128, 128, 4), (128, 128, 2)]  # (block_m, block_n, stages)
PROGRAM_FRACTIONS = [1.0, 0.9, 0.8, 0.65]  # of the SM count
PRIORITIES = ["highest", 0]


def sweep_configs(sms: int, chunks: int, tiles=TILES, fractions=PROGRAM_FRACTIONS) -> list[dict]:
    """cuBLAS first, then every (tile, stages, programs) of the sweep."""
    out = [{"chunks": chunks, "block_m": None, "block_n": None, "stages": None}]
    for (bm, bn, st), f in itertools.product(tiles, fractions):
        out.append({"chunks": chunks, "block_m": bm, "block_n": bn, "stages": st, "programs": max(1, int(sms * f))})
    return out


def _plan(kind: str, m: int, n: int, k: int, world: int, config: dict):
    from overlap_compile.templates.plans import GemmCollectivePlan

    if kind == "gemm_allreduce":
        outer, chunk = 1, m
    else:
        outer, chunk = 1, m // world
    return GemmCollectivePlan(template="priority_stream", kind=kind, m=m, n=n, k=k, world=world,
                              reduce_op=None if kind == "gemm_alltoall" else "sum", outer=outer, chunk=chunk,
                              has_bias=False, config=config)


def worker(args: dict) -> list[dict]:
    import overlap_compile as oc
    from overlap_compile.templates.priority_stream import kernels, reference

    kind, (m, n, k), chunks = args["kind"], args["shape"], args["chunks"]
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = torch.cuda.is_available() and not args["dry_run"]
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(rank)
    a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
    b = torch.randn(k, n, device=dev, dtype=dtype, generator=g) / k ** 0.5
    group = dist.group.WORLD
    run = kernels.run if cuda else reference.run
    timed = (lambda fn: time_ms(graphed(fn))) if cuda else time_ms
    mode = "cuda_graph" if cuda else "eager"
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 8
    base = {"benchmark": "occupancy", "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "world_size": world, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "kind": kind, "shape": [m, n, k], "mode": mode}

    seq = gemm_then_collective(kind, group.group_name, world)  # the pattern the compiler finds

    def sequential():
        return seq(a, b)

    want = sequential().float()
    rows = [{**base, "method": "sequential", "config": None, "ms": timed(sequential)}]
    configs = sweep_configs(sms, chunks) if cuda else sweep_configs(sms, chunks)[:1]
    for cfg in configs:
        plan = _plan(kind, m, n, k, world, cfg)
        mm = kernels.tile_gemm(cfg, dev) if cuda else None
        out = torch.empty(m, n, device=dev, dtype=dtype)
        gemm_ms = timed(lambda: mm(a, b, None, out)) if mm is not None else timed(lambda: torch.mm(a, b, out=out))
        for prio in PRIORITIES:
            with oc.config.patch(comm_priority=prio):
                fn = lambda: run(a, b, None, group.group_name, plan)  # noqa: E731
                got = fn().float()
                err = ((got - want).norm() / want.norm()).item()
                ms = timed(fn)
            rows.append({**base, "method": "priority_stream", "config": {**cfg, "priority": prio}, "ms": ms,
                         "gemm_ms": gemm_ms, "rel_err": err, "correct": err < 2e-2})
            if rank == 0:
                print(_row_text(rows[-1], rows[0]["ms"]), flush=True)
    return rows


def _row_text(r: dict, seq_ms: float) -> str:
    c = r["config"]
    tile = "cuBLAS" if c["block_m"] is None else f"{c['block_m']}x{c['block_n']} s{c['stages']} p{c['programs']}"
    return (f"{tile:>22} prio {str(c['priority']):>7}  op {r['ms']:7.3f} ms  x{seq_ms / r['ms']:.3f}  "
            f"GEMM alone {r['gemm_ms']:7.3f} ms  err {r['rel_err']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=max(torch.cuda.device_count(), 2))
    ap.add_argument("--kind", default="gemm_allreduce", choices=("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall"))
    ap.add_argument("--shape", default="8192,8192,4096", help="M,N,K of the GEMM (M: rows before the collective)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, a small shape, cuBLAS row only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    shape = [int(x) for x in a.shape.split(",")]
    if a.dry_run:
        shape = [64 * a.world, 48, 32]
    from overlap_compile.testing.multiprocess import run_distributed

    args = {"kind": a.kind, "shape": shape, "chunks": a.chunks, "dry_run": a.dry_run}
    rows = run_distributed(worker, world_size=a.world, args=(args,), backend="gloo" if a.dry_run else "nccl",
                           timeout_s=900)[0]
    path = write_rows(rows, a.out, "occupancy", rows[0]["device"], a.world)
    if not a.dry_run:
        plot_occupancy(rows, os.path.splitext(path)[0] + ".png")
    print("wrote", path)


if __name__ == "__main__":
    main()
