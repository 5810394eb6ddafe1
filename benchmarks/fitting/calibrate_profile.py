"""Fold measured benchmark rows into a hardware profile (JSON in, JSON out).

    python benchmarks/fitting/calibrate_profile.py --profile overlap_compile/predictor/profiles/h200.json \
        --ops benchmarks/results/ops-*.json --comm-slowdown 1.4 --gemm-slowdown-reserved 1.0 --out same.json

From each shape's "sequential" CUDA-graph row: the cuBLAS GEMM time goes into the GEMM table and
the collective's time into its curve at the measured world size (curve byte convention: the whole
buffer, see predictor/profile.py). The pieces were timed alone, host-launched with a barrier per
iteration, which adds 0.04-0.15 ms to each (their sum exceeded the graph-captured sequential
time on every shape, 4x H200): so the GEMM gets its time less ``--launch-ms`` and the collective
gets the captured sequential time minus that GEMM time, and the two add up to what was measured. Contention factors come from
calibrate_contention.py. The result is validated by loading it before it is written.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

COLLECTIVE = {"gemm_allreduce": "all_reduce", "gemm_reducescatter": "reduce_scatter", "gemm_alltoall": "all_to_all"}


def upsert_knot(curve: list, nbytes: int, ms: float) -> None:
    for knot in curve:
        if knot[0] == nbytes:
            knot[1] = ms
            return
    curve.append([nbytes, ms])
    curve.sort()


def main() -> None:
    from overlap_compile.predictor.profile import profile_from_dict, save_profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--ops", nargs="+", required=True)
    ap.add_argument("--comm-slowdown", type=float)
    ap.add_argument("--gemm-slowdown-reserved", type=float)
    ap.add_argument("--launch-ms", type=float, default=0.01, help="host launch + sync share of a lone GEMM timing")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.profile) as f:
        raw = json.load(f)
    seen = set()
    for path in args.ops:
        for r in json.load(open(path)):
            if r["method"] != "sequential" or r["mode"] != "cuda_graph" or r["kind"] not in COLLECTIVE:
                continue
            m, n, k = r["shape"]
            key = (m, n, k)
            gemm = max(r["gemm_ms"] - args.launch_ms, 1e-3)
            if key not in seen:
                table = raw["gemm"]["table"]
                table[:] = [e for e in table if (e["m"], e["n"], e["k"], e["dtype"]) != (m, n, k, "bfloat16")]
                table.append({"m": m, "n": n, "k": k, "dtype": "bfloat16", "config": None, "ms": round(gemm, 4)})
                seen.add(key)
            curve = raw["collectives"][COLLECTIVE[r["kind"]]].setdefault(str(r["world_size"]), [])
            upsert_knot(curve, m * n * 2, round(max(r["ms"] - gemm, 0.01), 4))
    if args.comm_slowdown:
        raw["contention"]["comm_slowdown"] = args.comm_slowdown
    if args.gemm_slowdown_reserved:
        raw["contention"]["gemm_slowdown_reserved"] = args.gemm_slowdown_reserved
    raw.setdefault("notes", []).append(
        f"{datetime.date.today().isoformat()}: calibrated with {', '.join(os.path.basename(p) for p in args.ops)} "
        f"(GEMM table, collective knots at the measured world size, contention fitted by "
        f"benchmarks/fitting/calibrate_contention.py)")
    profile_from_dict(raw, source=args.out)  # validate before writing
    save_profile(raw, args.out)
    print(f"wrote {args.out}: {len(seen)} GEMM shapes, contention {raw['contention']}")


if __name__ == "__main__":
    main()
