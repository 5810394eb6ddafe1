"""Cost of signal_reorder's post-communication reorder when Inductor fuses it into the consumer.

    python benchmarks/diagnostics/reorder_consumer.py --out $OUT          # one GPU, gemm_allreduce shapes, bf16
    python benchmarks/diagnostics/reorder_consumer.py --dry-run           # CPU, tiny shapes: correctness only

After an all-reduce in tile order the graph holds ``untile(buf)`` (view/permute/clone/cat/slice
from overlap_compile.tiling, exactly what the rewrite emits) followed by the model's next ops.
Here the next ops are a Llama block's: residual add then RMSNorm with a weight. Both versions are
compiled by torch.compile (Inductor) and timed:

    plain     rmsnorm(y + residual) * w                 y: [M, N] row-major (what the baseline has)
    reorder   rmsnorm(untile(buf) + residual) * w       buf: [tiles, BM, BN] in tile order

The overhead is reorder / plain - 1 (target <= 10%). Inputs are random (never zero),
the result of both is compared in the same run, times are triton.testing.do_bench medians
host-launched ("eager") and do_bench_cudagraph ("cuda_graph"). JSON rows follow the benchmark
schema and go to <out>/reorder-consumer-<device>-w1-torch<v>-<date>.json
(benchmarks/results_io.py); a table is printed last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

from benchmarks.results_io import write_rows  # noqa: E402
from overlap_compile.tiling import TileGrid, untile  # noqa: E402

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shapes.json
BLOCK = (128, 256, 8)  # BM, BN, group_m of signal_reorder's default Hopper kernel


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def plain(y, residual, w):
    return rmsnorm(y + residual, w)


def make_reorder(grid: TileGrid, pad: int = 0):
    """The consumer of a tile buffer whose slots are ``BM * BN + pad`` elements apart (``pad`` > 0:
    the padded send layout, which keeps a row's pieces off one power-of-two stride)."""
    slot = grid.block_m * grid.block_n

    def reorder(buf, residual, w):
        if pad:
            buf = buf.view(-1, slot + pad)[:, :slot].view(-1, grid.block_m, grid.block_n)
        return rmsnorm(untile(buf, grid) + residual, w)

    return reorder


def padded(buf: torch.Tensor, pad: int) -> torch.Tensor:
    """``buf`` [T, BM, BN] copied into slots of ``BM * BN + pad`` elements (the pad is random)."""
    if not pad:
        return buf
    t, bm, bn = buf.shape
    out = torch.randn(t, bm * bn + pad, dtype=buf.dtype, device=buf.device)
    out[:, :bm * bn] = buf.view(t, -1)
    return out.view(-1)


def tiles_of(y: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """The tile-order buffer whose untile is ``y`` (edge tiles padded with random values, which
    untile must slice away)."""
    from overlap_compile.tiling import tile_coords

    bm, bn = grid.block_m, grid.block_n
    buf = torch.randn(grid.tiles_m * grid.tiles_n, bm, bn, dtype=y.dtype, device=y.device)
    for t in range(buf.shape[0]):
        tm, tn = tile_coords(t, grid.tiles_m, grid.tiles_n, grid.group_m)
        blk = y[tm * bm:(tm + 1) * bm, tn * bn:(tn + 1) * bn]
        buf[t, :blk.shape[0], :blk.shape[1]] = blk
    return buf


def shapes(dry: bool) -> list[tuple[int, int]]:
    if dry:
        return [(300, 520), (256, 512)]
    with open(os.path.join(BENCHMARKS, "shapes.json")) as f:
        sets = json.load(f)
    out = []
    for m, n, _k in sets["gemm_allreduce"]:
        if (m, n) not in out:
            out.append((m, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--shapes", default=None, help="MxN,MxN,... (default: the gemm_allreduce outputs)")
    ap.add_argument("--pads", default="0", help="comma-separated slot paddings (elements) to try, 0 = none")
    ap.add_argument("--dynamic", default="false", help="false, true or false,true: compile with dynamic shapes "
                                                      "(each case starts from a reset Dynamo, so 'false' is static)")
    ap.add_argument("--code", action="store_true", help="also write Inductor's kernel source per case to --out")
    ap.add_argument("--blocks", default=None, help="BMxBNxGROUP_M,... tile layouts to try (default: the "
                                                  "Hopper kernel's %dx%dx%d)" % BLOCK)
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    blocks = ([tuple(map(int, b.split("x"))) for b in args.blocks.split(",")] if args.blocks
              else [(64, 128, 4) if dry else BLOCK])
    todo = ([tuple(map(int, x.split("x"))) for x in args.shapes.split(",")] if args.shapes else shapes(dry))
    rows = []
    date = datetime.date.today().isoformat()
    dev = "cpu" if dry else torch.cuda.get_device_name()
    pads = [int(p) for p in args.pads.split(",")]
    dynamics = [{"false": False, "true": True}[d] for d in args.dynamic.split(",")]
    cases = [(sh, bl, p, d) for sh in todo for bl in blocks for p in pads for d in dynamics]
    for (m, n), (bm, bn, gm), pad, dyn in cases:
        # A fresh Dynamo per case: reorder() of every case shares one code object, and a recompile
        # of it for a new shape would otherwise turn on automatic dynamic shapes (symbolic index
        # math, measured +67% at 8192x8192 on H200), which a model's static graph never sees.
        torch._dynamo.reset()
        grid = TileGrid(m, n, bm, bn, gm)
        torch.manual_seed(m + n)
        y = torch.randn(m, n, device=device, dtype=dtype)
        residual = torch.randn(m, n, device=device, dtype=dtype)
        w = torch.rand(n, device=device, dtype=dtype) + 0.5
        buf = padded(tiles_of(y, grid), pad)
        f_plain = torch.compile(plain, dynamic=dyn)
        f_reorder = torch.compile(make_reorder(grid, pad), dynamic=dyn)
        ref = f_plain(y, residual, w)
        if args.code and args.out:
            from torch._inductor.utils import run_and_get_code

            got, code = run_and_get_code(f_reorder, buf, residual, w)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"reorder-code-{m}x{n}-{bm}x{bn}x{gm}-pad{pad}{'-dynamic' if dyn else ''}.py"), "w") as f:
                f.write("\n\n".join(code))
        else:
            got = f_reorder(buf, residual, w)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        entry = {"benchmark": "reorder_consumer", "device": dev, "torch": torch.__version__, "date": date,
                 "shape": [m, n], "block": [bm, bn, gm], "pad": pad, "dynamic": dyn, "dtype": str(dtype).replace("torch.", ""),
                 # the two compiled kernels may split the row reduction differently: allow one bf16 ulp
                 "max_rel_err": err, "correct": err <= (0.0 if dry else 2 ** -7)}
        if dry:
            t0 = time.perf_counter()
            f_reorder(buf, residual, w)
            entry["modes"] = {"eager": {"plain_ms": None, "reorder_ms": (time.perf_counter() - t0) * 1e3}}
        else:
            import triton.testing as tt

            entry["modes"] = {}
            for mode, bench in (("eager", tt.do_bench), ("cuda_graph", tt.do_bench_cudagraph)):
                p = bench(lambda: f_plain(y, residual, w))
                r = bench(lambda: f_reorder(buf, residual, w))
                entry["modes"][mode] = {"plain_ms": p, "reorder_ms": r, "overhead": r / p - 1}
        rows.append(entry)
    print(f"{'shape':>14} {'block':>12} {'pad':>4} {'dyn':>4} {'err':>8} " + " ".join(f"{m + ' plain/reorder/overhead':>36}" for m in ("eager", "cuda_graph")))
    for e in rows:
        cells = []
        for mode in ("eager", "cuda_graph"):
            v = e["modes"].get(mode)
            cells.append(f"{v['plain_ms']:.4f}/{v['reorder_ms']:.4f}/{v['overhead']:+.1%}".rjust(36)
                         if v and v.get("plain_ms") else "-".rjust(36))
        print(f"{str(e['shape']):>14} {'x'.join(map(str, e['block'])):>12} {e['pad']:>4} {'yes' if e['dynamic'] else 'no':>4} {e['max_rel_err']:8.1e} " + " ".join(cells))
    bad = [e["shape"] for e in rows if not e["correct"]]
    if bad:
        print("reorder result differs from plain on", bad)
    if args.out:
        path = write_rows(rows, args.out, "reorder-consumer", dev, 1, date=date)
        print("wrote", path)
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
