"""Fit model.packed_overhead_ms's two constants to measured moe_fused op replays.

    python benchmarks/fitting/fit_packed_overhead.py benchmarks/results/moe_op_profile-*-2026-11-27.json --profile h100

Input: benchmarks/diagnostics/moe_op_profile.py rows (rank 0's), each shape with the bmm copy
engine and ``"experts": "packed"``, forward and backward CUDA-graph times. Per shape and
direction the packed time the model should give is the measured packed / bmm ratio times the
model's bmm time; what the model lacks there, beyond the packed GEMMs and the padding scan, is the
overhead to fit: ``factor * hbm_ms(bytes moved) + pieces * piece_ms`` (least squares, the two
constants only). Prints the fit (``moe.packed_move_factor``, ``moe.packed_piece_ms``, the
profile's keys), then each case's measured and fitted ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

BMM = {"split": "source", "transport": "p2p"}
PACKED = {**BMM, "experts": "packed"}


def cases(rows: list[dict], shapes: dict[str, dict]) -> list[dict]:
    """(shape, direction, measured packed / bmm, the Site) for every shape of one file's rows with
    both configs."""
    from overlap_compile.templates.moe_fused.model import section_sites

    by_shape: dict[str, dict] = {}
    for r in rows:
        if r.get("rank", 0) == 0 and r["config"] in (BMM, PACKED):
            by_shape.setdefault(r["shape"], {})["packed" if r["config"] == PACKED else "bmm"] = r
    out = []
    for name, got in sorted(by_shape.items()):
        if set(got) != {"bmm", "packed"}:
            continue
        s, w = shapes[name], got["bmm"]["world_size"]
        sites = section_sites(w, s["E"] // w, got["bmm"]["capacity"], s["H"], s["I"])
        for direction, site in zip(("forward", "backward"), sites):
            key = f"{direction}/cuda_graph"
            out.append({"shape": name, "direction": direction, "site": site,
                        "ratio": got["packed"]["ms"][key] / got["bmm"]["ms"][key]})
    return out


def fit(found: list[dict], profile) -> tuple[float, float, list[tuple[dict, float]]]:
    """(factor, piece ms, [(case, fitted ratio)]): least squares over every case."""
    from overlap_compile.predictor.models import Ctx
    from overlap_compile.templates.moe_fused import model

    ctx = Ctx(mode="cuda_graph")
    rows = []  # (hbm ms of the bytes, pieces, overhead needed, bmm ms, packed ms without its overhead)
    for c in found:
        site, backward = c["site"], c["direction"] == "backward"
        bmm = model.moe_fused(site, BMM, profile, ctx).total_ms
        bare = model.moe_fused(site, PACKED, profile, ctx).total_ms - model.packed_overhead_ms(site, profile, backward)
        hbm, pieces = model.packed_overhead_terms(site, profile, backward)
        rows.append((hbm, pieces, c["ratio"] * bmm - bare, bmm, bare))
    # normal equations of need = factor * hbm + piece_ms * pieces
    sxx = sum(h * h for h, *_ in rows)
    sxp = sum(h * p for h, p, *_ in rows)
    spp = sum(p * p for _, p, *_ in rows)
    sxy = sum(h * y for h, _, y, *_ in rows)
    spy = sum(p * y for _, p, y, *_ in rows)
    det = sxx * spp - sxp * sxp
    if not rows or abs(det) < 1e-18:
        raise SystemExit("fit_packed_overhead: too few distinct cases to fit two constants")
    factor, piece = (sxy * spp - spy * sxp) / det, (spy * sxx - sxy * sxp) / det
    fitted = [(c, (bare + factor * hbm + piece * p) / bmm) for c, (hbm, p, _, bmm, bare) in zip(found, rows)]
    return factor, piece, fitted


def main() -> None:
    from overlap_compile import predictor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="moe_op_profile-*.json files")
    ap.add_argument("--profile", default="h100")
    a = ap.parse_args()
    from benchmarks.shape_sets import shapes_by_name

    shapes = shapes_by_name("moe")
    found = []
    for path in a.results:  # each file's cases on their own: its bmm rows are its baseline
        with open(path) as f:
            found += [{**c, "file": os.path.basename(path)} for c in cases(json.load(f), shapes)]
    profile = predictor.load_profile(a.profile)
    factor, piece, fitted = fit(found, profile)
    print(f"moe.packed_move_factor {factor:.3f}   moe.packed_piece_ms {piece:.4f}")
    for c, got in fitted:
        print(f"  {c['shape']:>14} {c['direction']:>8}: measured {c['ratio']:.3f}x of bmm, fitted {got:.3f}x  "
              f"({c['file']})")


if __name__ == "__main__":
    main()
