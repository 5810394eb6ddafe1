"""moe_fused's persistent SwiGLU expert kernel vs the experts as the layer writes them (cuBLAS bmm,
SiLU, product, bmm), one GPU.

    python benchmarks/moe_experts.py --out $OUT                 # shapes.json "moe" set, W = 2 and 4
    python benchmarks/moe_experts.py --world 2 --limit 2        # fewer cases

Per shape and world size W the rank's work is x ``[W, E/W, C, H]`` (C = the layer's capacity,
tokens x top-k / E x 1.25). Timed (triton.testing.do_bench medians, warm-up first, random
inputs, bf16): ``bmm`` (reference.experts per source, what the section does), and the kernel per
tile config, with every source marked arrived (``fused``) and with the arrival waits on and
the flags set before each call (``fused_waits``: what the copy-engine path will run). Both
host-launched ("eager") and in a CUDA graph (10 calls). Every kernel result is checked against
bmm in the same run (``correct``: relative max error <= 2e-2, a few bf16 ulps of the stored
activation). ``--routing uniform|skewed``: x holds the slots demo.moe's routing fills (zeros past
each expert's tokens) and the kernel also runs with their routed sizes (``fused_sized``: tiles
past them skipped, no host round trip), first three tile configs only (the tile orders). Rows go to <out>/moe_experts-<device>-w1-torch<v>-<date>.json (benchmarks/results_io.py); a
table with the ratios last.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.results_io import write_rows  # noqa: E402
from overlap_compile.templates.moe_fused import expert_kernel as EK  # noqa: E402
from overlap_compile.templates.moe_fused import reference  # noqa: E402

# The first three differ only in how tiles are taken, defaults first (the dynamic ticket, row
# blocks in groups of 8), then the static p, p + P, ... and the row-major order (group_m=1) they
# replaced, so every run compares them; the rest vary the tile, stages, warps and waits.
CONFIGS = [EK.ExpertTiles(128, 128, 256, 64, 8, 3), EK.ExpertTiles(128, 128, 256, 64, 8, 3, schedule="static"),
           EK.ExpertTiles(128, 128, 256, 64, 8, 3, group_m=1),
           EK.ExpertTiles(128, 128, 256, 64, 8, 4),
           EK.ExpertTiles(128, 128, 128, 64, 8, 3), EK.ExpertTiles(128, 128, 256, 64, 4, 3),
           EK.ExpertTiles(128, 128, 256, 64, 8, 3, tma_waits=False),  # x by pointers when tiles wait
           EK.ExpertTiles(128, 128, 128, 64, 8, 3, tma=False),  # pointer loads only, as before TMA
           EK.ExpertTiles(128, 128, 256, 64, 8, 3, group_m=4), EK.ExpertTiles(128, 128, 256, 64, 8, 3, group_m=16),
           EK.ExpertTiles(128, 128, 256, 64, 8, 4, group_m=16)]


def config_label(cfg: EK.ExpertTiles) -> str:
    """A row's ``config``: the tile sizes, warps and stages, then what differs from the defaults."""
    return (f"{cfg.block_m}x{cfg.block_f}x{cfg.block_h}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            + ("" if cfg.tma else " ptr") + ("" if cfg.tma_waits or not cfg.tma else " xptr-waits")
            + ("" if cfg.schedule == "dynamic" else f" {cfg.schedule}")
            + ("" if cfg.group_m == 8 else f" group_m={cfg.group_m}"))


def keep_rows(x, ws, w, e, c, h, f, base, flops, want, do_bench, do_bench_cudagraph) -> list[dict]:
    """``bmm_keep``: the bmm experts copying tokens, gate, up and act into the saved expert-major
    ``[E, W * C, *]`` tensors (kernels.py's bmm path); ``fused_keep``: the kernel (default tiles)
    reading the tokens from and writing the three into that layout directly."""
    saved = {r: x.new_empty(e, w * c, h if r == "tokens" else f) for r in ("tokens", "gate", "up", "act")}
    by_source = {r: t.view(e, w, c, t.shape[-1]).permute(1, 0, 2, 3) for r, t in saved.items()}
    out = torch.empty_like(x)
    by_source["tokens"].copy_(x)
    counters = EK.Counters.make(w, e, c, EK.ExpertTiles().block_m, x.device)

    def bmm_keep():
        for s in range(w):
            reference.experts(x[s], *ws, out=out[s], keep={r: t[:, s * c:(s + 1) * c] for r, t in saved.items()})

    def fused_keep():
        return EK.swiglu_experts(by_source["tokens"], *ws, 0, counters=counters,
                                 keep={r: by_source[r] for r in ("act", "gate", "up")})

    fused_keep()
    got = fused_keep()
    EK.check_errors(counters.err)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    bmm_keep()
    kept = {r: t.clone() for r, t in saved.items()}
    fused_keep()
    for r in ("gate", "up", "act"):
        err = max(err, ((saved[r].float() - kept[r].float()).abs().max() / kept[r].float().abs().max()).item())
    out_rows, t_ref = [], {}
    for method, fn in (("bmm_keep", bmm_keep), ("fused_keep", fused_keep)):
        for mode, bench in (("eager", do_bench), ("cuda_graph", do_bench_cudagraph)):
            ms = bench(fn, return_mode="median")
            t_ref.setdefault(mode, ms)
            out_rows.append({**base, "method": method, "config": config_label(EK.ExpertTiles()), "mode": mode,
                             "ms": ms, "tflops": flops / ms / 1e9, "correct": err <= 2e-2, "rel_err": err,
                             "speedup_vs_bmm_keep": t_ref[mode] / ms})
    print(f"{base['shape']} W={w} keep (CUDA graph): bmm {out_rows[1]['ms']:.3f} ms, fused {out_rows[3]['ms']:.3f} ms "
          f"({out_rows[3]['speedup_vs_bmm_keep']:.2f}x), rel err {err:.3g}", flush=True)
    return out_rows


def cases(world_sizes: list[int]) -> list[dict]:
    from overlap_compile.demo.moe import capacity

    from benchmarks.shape_sets import shape_set

    shapes = shape_set("moe")
    out = []
    for sh in shapes:
        for w in world_sizes:
            if sh["E"] % w:
                continue
            out.append({"name": sh["name"], "world": w, "e": sh["E"] // w, "h": sh["H"], "f": sh["I"],
                        "c": capacity(sh["S"], sh["E"], sh["topk"], 1.25), "shape": sh})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--world", default="2,4", help="world sizes whose per-rank work to time")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--routing", default="random", choices=("random", "uniform", "skewed"),
                    help="random: every slot holds a token (as before); uniform / skewed: the slots demo.moe's "
                         "routing fills (zeros past each expert's tokens), and the kernel also runs with the "
                         "routed sizes (fused_sized: tiles past them skipped), first three configs only: the tile orders")
    ap.add_argument("--configs", type=int, default=0, help="time only the first N tile configs (0: all; "
                    "--routing uniform|skewed times the first three: the tile orders)")
    ap.add_argument("--keep", action="store_true", help="also time a training section's experts (bmm_keep, "
                    "fused_keep): the intermediates backward reads kept in their layout")
    ap.add_argument("--suffix", default="", help="appended to the result file's name (runs of one day apart)")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda", 0)
    device, date = torch.cuda.get_device_name(dev), datetime.date.today().isoformat()
    todo = cases([int(w) for w in args.world.split(",")])
    todo = todo[: args.limit] if args.limit else todo
    rows, table = [], []
    for case in todo:
        w, e, c, h, f = case["world"], case["e"], case["c"], case["h"], case["f"]
        g = torch.Generator(device=dev).manual_seed(w * 1000 + e)
        if args.routing == "random":
            x = torch.randn(w, e, c, h, device=dev, dtype=torch.bfloat16, generator=g)
            sizes = None
        else:
            from benchmarks.diagnostics.moe_routed_experts import dispatched_slots
            from overlap_compile.templates.moe_fused.routed import routed_sizes

            torch.manual_seed(w * 1000 + e)
            x = dispatched_slots(case["shape"], w, args.routing, dev, torch.bfloat16).contiguous()
            sizes = routed_sizes(x)
        ws = [torch.randn(e, h, f, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(h),
              torch.randn(e, h, f, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(h),
              torch.randn(e, f, h, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(f)]
        out = torch.empty_like(x)

        def bmm():
            for s in range(w):
                reference.experts(x[s], *ws, out=out[s])

        bmm()
        want = out.float().clone()
        flops = 2 * w * e * c * (3 * h * f)
        base = {"benchmark": "moe_experts", "device": device, "torch": torch.__version__,
                "triton": triton.__version__, "date": date, "shape": case["name"], "world": w,
                "dims": {"e_local": e, "capacity": c, "hidden": h, "ffn": f}, "dtype": "bfloat16",
                "routing": args.routing}
        if sizes is not None:
            base["fill"] = sizes.sum().item() / (w * e * c)
        t_bmm = {"eager": do_bench(bmm, return_mode="median"),
                 "cuda_graph": do_bench_cudagraph(bmm, return_mode="median")}
        for mode, ms in t_bmm.items():
            rows.append({**base, "method": "bmm", "mode": mode, "ms": ms, "tflops": flops / ms / 1e9})
        for cfg in CONFIGS[: args.configs or (len(CONFIGS) if sizes is None else 3)]:
            counters = EK.Counters.make(w, e, c, cfg.block_m, dev)
            label = config_label(cfg)
            try:
                got = EK.swiglu_experts(x, *ws, 0, cfg, counters=counters)
                EK.check_errors(counters.err)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
            except Exception as ex:  # a config this Triton cannot build: recorded, the sweep goes on
                rows.append({**base, "method": "fused", "config": label, "error": f"{type(ex).__name__}: {ex}"[:500]})
                continue
            flags = counters.arrival.view(torch.int32)

            def fused():
                EK.swiglu_experts(x, *ws, 0, cfg, counters=counters)

            def fused_waits():
                flags.fill_(1)  # what the copy stream's flag writes do as each piece lands
                EK.swiglu_experts(x, *ws, 0, cfg, counters=counters, arrived=False)

            def fused_sized():
                EK.swiglu_experts(x, *ws, 0, cfg, counters=counters, sizes=sizes)

            methods = [("fused", fused), ("fused_waits", fused_waits)]
            if sizes is not None:
                got = EK.swiglu_experts(x, *ws, 0, cfg, counters=counters, sizes=sizes)
                EK.check_errors(counters.err)
                sized_err = ((got.float() - want).abs().max() / want.abs().max()).item()
                err = max(err, sized_err)
                methods = [("fused", fused), ("fused_sized", fused_sized)]
            for method, fn in methods:
                for mode, bench in (("eager", do_bench), ("cuda_graph", do_bench_cudagraph)):
                    ms = bench(fn, return_mode="median")
                    rows.append({**base, "method": method, "config": label, "mode": mode, "ms": ms,
                                 "tflops": flops / ms / 1e9, "correct": err <= 2e-2, "rel_err": err,
                                 "speedup_vs_bmm": t_bmm[mode] / ms})
            EK.check_errors(counters.err)
        if args.keep:  # a training section: both keep what backward reads, in its layout
            rows += keep_rows(x, ws, w, e, c, h, f, base, flops, want, do_bench, do_bench_cudagraph)
        best = {}
        for r in rows:
            if r.get("shape") == case["name"] and r.get("world") == w and r.get("method") in ("fused", "fused_waits", "fused_sized") \
                    and r.get("mode") == "cuda_graph" and r.get("correct"):
                if r["method"] not in best or r["ms"] < best[r["method"]]["ms"]:
                    best[r["method"]] = r
        table.append((case, t_bmm["cuda_graph"], best))
        print(f"{case['name']} W={w}: bmm {t_bmm['cuda_graph']:.3f} ms, fused "
              + ", ".join(f"{m} {b['ms']:.3f} ({b['speedup_vs_bmm']:.2f}x, {b['config']})" for m, b in best.items()),
              flush=True)
        del x, ws, out
        torch.cuda.empty_cache()
    path = write_rows(rows, args.out, "moe_experts", device, 1, date=date, suffix=args.suffix)
    print(f"\nwrote {path}\n{'shape':>16} {'W':>2} {'E':>3} {'C':>6} {'bmm ms':>8} {'fused':>8} {'x':>6} "
          f"{'+waits' if args.routing == 'random' else 'sized':>8} {'x':>6}")
    for case, tb, best in table:
        cells = []
        for m in ("fused", "fused_waits" if args.routing == "random" else "fused_sized"):
            b = best.get(m)
            cells += [f"{b['ms']:8.3f}", f"{b['speedup_vs_bmm']:6.2f}"] if b else ["       -", "     -"]
        print(f"{case['name']:>16} {case['world']:>2} {case['e']:>3} {case['c']:>6} {tb:8.3f} " + " ".join(cells))
    by_config: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("mode") == "cuda_graph" and r.get("correct") and r["method"] != "bmm":
            by_config.setdefault((r["method"], r["config"]), []).append(r["speedup_vs_bmm"])
    for (m, label), ratios in sorted(by_config.items()):
        print(f"{m:>12} {label:<36} vs bmm (CUDA graph, {len(ratios)} cases): geomean "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, min {min(ratios):.3f}")
    for m in ("fused", "fused_sized"):
        ratios = [best[m]["speedup_vs_bmm"] for _, _, best in table if m in best]
        if ratios:
            print(f"{m} vs bmm (CUDA graph, best config per case): geomean "
                  f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, min {min(ratios):.3f}")


if __name__ == "__main__":
    main()
