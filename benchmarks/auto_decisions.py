"""What "auto" (the predictor) chooses on every measured shape, and what that choice measured.

    python benchmarks/auto_decisions.py [--mode cuda_graph|eager] [--profile h200]

Reads benchmarks/results/ops-NVIDIA_H200-w4-*.json (sequential and each template, measured in
the same runs), decides each shape with the built-in profile on a fake 4-rank process group, and
prints a markdown table: per-template measured speedups, the choice, and its measured speedup.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def main() -> None:
    from torch._inductor import config as ic

    from overlap_compile import config, predictor
    from overlap_compile.passes.decide import decide
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site as _site

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="cuda_graph", choices=["cuda_graph", "eager"])
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args()
    rows = [r for p in sorted(glob.glob(os.path.join(HERE, "results", "ops-NVIDIA_H200-w4-*.json"))) for r in json.load(open(p))]
    by: dict = {}
    for r in rows:
        if r["mode"] == args.mode and r["ms"] == r["ms"]:
            d = by.setdefault((r["kind"], tuple(r["shape"])), {})
            d[r["method"]] = min(r["ms"], d.get(r["method"], float("inf")))
    prof = predictor.load_profile(args.profile)
    methods = sorted({m for d in by.values() for m in d if m != "sequential"})
    print(f"mode {args.mode}, profile {prof.name}\n")
    print("| kind | shape | sequential ms | " + " | ".join(methods) + " | auto chose | auto speedup |")
    print("|---" * (len(methods) + 5) + "|")
    speedups: dict = {}
    for (kind, shape), ms in sorted(by.items()):
        with ic.patch({"triton.cudagraphs": args.mode == "cuda_graph"}), fake_process_group(4):
            (d,) = decide([_site(kind, *shape, 4)], config.current(), prof)
        chosen = ms.get(d.template, ms["sequential"]) if d.template != "baseline" else ms["sequential"]
        s = ms["sequential"] / chosen
        speedups.setdefault(kind, []).append(s)
        cells = [f"{ms['sequential'] / ms[m]:.2f}x" if m in ms else "-" for m in methods]
        print(f"| {kind} | {'x'.join(map(str, shape))} | {ms['sequential']:.3f} | " + " | ".join(cells)
              + f" | {d.template} | {s:.2f}x |")
    print()
    for k, v in speedups.items():
        print(f"- {k}: auto geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x, min {min(v):.3f}x, max {max(v):.3f}x")


if __name__ == "__main__":
    main()
