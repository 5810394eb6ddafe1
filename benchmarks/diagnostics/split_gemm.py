"""What cutting a GEMM's rows into pieces costs on one GPU, against what the latency models price.

    python benchmarks/diagnostics/split_gemm.py --out $OUT              # shapes.json, pieces 2,4,8
    python benchmarks/diagnostics/split_gemm.py --pieces 2,4 --limit 3  # smoke run

p2p_ring and priority_stream run a site's GEMM as row pieces (W ring steps x ``slices``, or
``chunks``): ``torch.mm`` on M / p rows at a time, back to back on one stream. Per (M, N, K) and p
this times the whole ``torch.mm`` and its p pieces, in CUDA graphs of 10 calls (kernel time) and
host-launched, alternating in ``--repeat`` rounds (median), and sets beside the measured ratio
(pieces / whole) the two prices the models could use:
- ``model``: ``predictor.models.slice_ms`` x p / the whole GEMM: what the templates' models
  charge for the pieces;
- ``table``: the profile's GEMM table interpolated at M / p rows, x p / the whole.
Shapes: the gemm_* sets of shapes.json (``--shapes``: another file) and, per dense e2e block of
benchmarks/shapes.json (TP+SP Llama), the GEMMs of its sites at W = ``--world``, forward and backward, fused (QKV, gate/up) and separate. No
communication runs: this is the pieces' own cost, not what a transfer beside them adds.
Rows (one schema, results_io) go to <out>/split_gemm-<device>-w1-torch<v>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

from benchmarks.gemm import load_shapes  # noqa: E402


def block_site_gemms(block: dict, world: int) -> dict[tuple[int, int, int], list[str]]:
    """(M, N, K) -> labels of the GEMMs a TP+SP Llama block's sites run at world ``world``: the
    all-gathers' consumers and the reduce-scatters' producers, forward and backward (input
    gradients), with fused QKV / gate-up and with separate projections."""
    h, ffn, heads, kv = block["hidden"], block["intermediate"], block["heads"], block["kv_heads"]
    d, m, name = h // heads, block["seq"] * block["batch"], block["name"]
    q, k_v, f = heads * d // world, kv * d // world, ffn // world
    gemms = {
        "fwd AG -> fused QKV": (m, q + 2 * k_v, h), "fwd AG -> wq": (m, q, h), "fwd AG -> wk/wv": (m, k_v, h),
        "fwd wo -> RS": (m, h, q), "fwd AG -> gate/up": (m, 2 * f, h), "fwd AG -> w1/w3": (m, f, h),
        "fwd w2 -> RS": (m, h, f),
        "bwd AG -> dgrad w2": (m, f, h), "bwd dgrad gate/up -> RS": (m, h, 2 * f), "bwd dgrad w1/w3 -> RS": (m, h, f),
        "bwd AG -> dgrad wo": (m, q, h), "bwd dgrad QKV -> RS": (m, h, q + 2 * k_v), "bwd dgrad wq -> RS": (m, h, q),
    }
    out: dict[tuple[int, int, int], list[str]] = {}
    for label, shape in gemms.items():
        out.setdefault(shape, []).append(f"{name}: {label}")
    return out


def shapes_to_time(shapes_path: str | None, world: int) -> dict[tuple[int, int, int], list[str]]:
    from benchmarks.shape_sets import shape_set

    shapes = load_shapes(shapes_path)
    for block in shape_set("e2e"):
        if "E" not in block:  # the dense TP+SP blocks (the MoE block's experts are no site GEMMs)
            for shape, labels in block_site_gemms(block, world).items():
                shapes.setdefault(shape, []).extend(labels)
    return shapes


def priced(profile, m: int, n: int, k: int, pieces: int) -> dict:
    """The models' and the table's price of ``pieces`` row pieces over the whole GEMM."""
    from overlap_compile.predictor.models import Site, slice_ms

    site = Site("allgather_gemm", ((m, n, k),), pieces, "bfloat16")
    whole = profile.gemm.ms(m, n, k, "bfloat16")
    rows = m // pieces
    return {"model_ratio": pieces * slice_ms(site, profile, rows) / whole,
            "table_ratio": pieces * profile.gemm.ms(rows, n, k, "bfloat16") / whole, "whole_model_ms": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="the gemm_* sets' shapes.json (default: gemm.py's)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "..", "results"))
    ap.add_argument("--pieces", default="2,4,8", help="comma-separated piece counts")
    ap.add_argument("--world", type=int, default=2, help="world size of the e2e blocks' site GEMMs")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds (median)")
    ap.add_argument("--rep", type=int, default=60, help="do_bench repetition time (ms)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N shapes (smoke runs)")
    args = ap.parse_args()

    import torch

    from benchmarks.results_io import write_rows
    from benchmarks.timing import kernel_and_host_timers, one_gpu

    dev, device, profile, date = one_gpu()
    pieces_list = [int(p) for p in args.pieces.split(",")]
    shapes = list(shapes_to_time(args.shapes, args.world).items())[: args.limit or None]
    rows = []

    for (m, n, k), labels in shapes:
        g = torch.Generator(device=dev).manual_seed(m + 3 * n + 7 * k)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=g)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        want = torch.mm(a, b)
        variants = {1: kernel_and_host_timers(lambda: torch.mm(a, b, out=out), args.rep)}
        for p in pieces_list:
            if m % p:
                continue
            r = m // p

            def split(p=p, r=r):
                for i in range(p):
                    torch.mm(a[i * r:(i + 1) * r], b, out=out[i * r:(i + 1) * r])

            out.zero_()
            split()
            if not torch.equal(out, want):  # same kernel on fewer rows: bitwise equal per row expected
                err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
                assert err < 1e-2, f"{m}x{n}x{k} in {p} pieces: relative error {err:.2e}"
            variants[p] = kernel_and_host_timers(split, args.rep)
        for mode in ("cuda_graph", "eager"):
            got = {p: [] for p in variants}
            for _ in range(args.repeat):
                for p, t in variants.items():
                    got[p].append(t[mode]())
            med = {p: statistics.median(v) for p, v in got.items()}
            for p, ms in med.items():
                row = {"benchmark": "split_gemm", "device": device, "world_size": 1, "torch": torch.__version__,
                       "date": date, "shape": [m, n, k], "sets": labels, "method": "whole" if p == 1 else "pieces",
                       "pieces": p, "mode": mode, "ms": ms, "dtype": "bfloat16", "profile": profile.name}
                if p > 1:
                    row.update(measured_ratio=ms / med[1], **priced(profile, m, n, k, p))
                rows.append(row)
        line = "  ".join(f"p={r['pieces']} {r['measured_ratio']:.3f} (model {r['model_ratio']:.3f}, "
                         f"table {r['table_ratio']:.3f})" for r in rows[-len(variants):] if r["pieces"] > 1)
        print(f"{m}x{n}x{k} whole {med[1]:.3f} ms (eager)  {line}", flush=True)
        del a, b, out, want
        torch.cuda.empty_cache()

    table = markdown(rows)
    path = write_rows(rows, args.out, "split_gemm", device, 1, date=date, table=table)
    print(f"\nwrote {path}\n\n{table}")


def markdown(rows: list[dict]) -> str:
    """Per shape: the whole GEMM's kernel time and, per piece count, measured / model / table ratios
    (CUDA graph), then the medians of each over the shapes."""
    graph = [r for r in rows if r["mode"] == "cuda_graph"]
    pieces = sorted({r["pieces"] for r in graph if r["pieces"] > 1})
    head = "| M x N x K | whole ms | " + " | ".join(f"{p} pieces: measured / model / table" for p in pieces) + " |"
    lines = [head, "|" + "---|" * (2 + len(pieces))]
    by_shape: dict[tuple, dict] = {}
    for r in graph:
        by_shape.setdefault(tuple(r["shape"]), {})[r["pieces"]] = r
    for shape, per in by_shape.items():
        cells = [f"{per[p]['measured_ratio']:.3f} / {per[p]['model_ratio']:.3f} / {per[p]['table_ratio']:.3f}"
                 if p in per else "-" for p in pieces]
        lines.append(f"| {'x'.join(map(str, shape))} | {per[1]['ms']:.3f} | " + " | ".join(cells) + " |")
    meds = []
    for p in pieces:
        got = [per[p] for per in by_shape.values() if p in per]
        meds.append(" / ".join(f"{statistics.median(r[key] for r in got):.3f}"
                               for key in ("measured_ratio", "model_ratio", "table_ratio")) if got else "-")
    lines.append("| median | | " + " | ".join(meds) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
