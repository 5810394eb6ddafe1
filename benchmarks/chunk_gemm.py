"""priority_stream's chunked GEMMs alone, on one GPU: what cutting a GEMM into chunks costs
before any communication.

    python benchmarks/chunk_gemm.py --out $OUT

For every all-gather and reduce-scatter shape of shapes.json, W = 2 and 4, chunks 1, 2, 4: the
GEMM work of priority_stream's op exactly as its kernels issue it, back to back on one stream
(``reference.gemm_gathered`` per chunk of the gathered rows, ``reference.compute_chunk`` per
chunk of the output), timed against one ``torch.mm`` of the whole GEMM, and beside what the
latency model prices (``models.gemm_ms`` of each chunk's rows). The rows whose chunks run as
batched GEMMs (``bmm`` over W strided blocks) show whether those cost more than the model says.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import graphed, time_ms  # noqa: E402

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.json")


def chunked(kind: str, m: int, n: int, k: int, world: int, chunks: int):
    """The op's GEMM calls for one call, as a function, plus the chunk row counts."""
    from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan
    from overlap_compile.templates.priority_stream import reference as ref

    cfg = {"chunks": chunks, "block_m": None, "block_n": None, "stages": None}
    dt, dev = torch.bfloat16, "cuda"
    b = torch.randn(k, n, device=dev, dtype=dt) / k ** 0.5
    if kind == "allgather_gemm":
        plan = AllGatherGemmPlan("priority_stream", m, k, (n,), world, 1, m // world, (False,), cfg)
        lay = ref.allgather_layout(plan)
        direct = len(lay.chunks) == 1
        gath = torch.randn(m, k, device=dev, dtype=dt)
        y = torch.empty(m, n, device=dev, dtype=dt)
        parts = [gath[slice(*lay.buffer_rows(c))] for c in range(len(lay.chunks))]

        def run():
            for c, g in enumerate(parts):
                ref.gemm_gathered(gath if direct else g, [b], [None], [y], lay, c)
        return run, [world * (hi - lo) for lo, hi in lay.chunks], gath, b
    plan = GemmCollectivePlan("priority_stream", kind, m, n, k, world, "sum", 1, m // world, False, cfg)
    lay = ref.gemm_layout(plan)
    a = torch.randn(m, k, device=dev, dtype=dt)
    send = torch.empty(m, n, device=dev, dtype=dt)

    def run():
        for c in range(len(lay.chunks)):
            ref.compute_chunk(a, b, None, lay, c, send[slice(*lay.buffer_rows(c))])
    return run, [lay.world * (hi - lo) for lo, hi in lay.chunks], a, b


def main() -> None:
    from overlap_compile import predictor
    from overlap_compile.predictor.models import Site, gemm_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    prof = predictor.load_profile(args.profile)
    shapes = json.load(open(SHAPES))
    rows = []
    for kind in ("allgather_gemm", "gemm_reducescatter"):
        for m, n, k in shapes[kind]:
            for world in (2, 4):
                site = Site(kind, ((m, n, k),), world, "bfloat16")
                full = None
                for chunks in (1, 2, 4):
                    run, chunk_rows, a, b = chunked(kind, m, n, k, world, chunks)
                    ms = time_ms(graphed(run))
                    if full is None:
                        full = time_ms(graphed(lambda a=a, b=b: torch.mm(a, b)))
                    model = sum(gemm_ms(site, prof, m=r) for r in chunk_rows)
                    rows.append({"benchmark": "chunk_gemm", "device": torch.cuda.get_device_name(),
                                 "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                                 "kind": kind, "shape": [m, n, k], "world_size": world, "chunks": chunks,
                                 "ms": ms, "mm_ms": full, "model_ms": model, "mode": "cuda_graph"})
                    print(f"{kind:>20} {str([m, n, k]):>20} W={world} chunks={chunks}: {ms:.4f} ms "
                          f"= {ms / full:.3f}x one mm; model {model:.4f} ms ({model / ms - 1:+.1%})", flush=True)
    if args.out:
        path = os.path.join(args.out, f"chunk_gemm-{torch.cuda.get_device_name().replace(' ', '_')}-"
                                      f"{datetime.date.today().isoformat()}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
