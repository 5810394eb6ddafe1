"""Replay measured runs against a profile on CPU: how far off is the predictor, per mode, kind and
method, without a GPU.

    python benchmarks/predictor_replay.py benchmarks/results/predictor-*.json --profile h200

Reads rows of ``benchmarks/predictor.py`` / ``benchmarks/ops.py`` (method ``sequential`` or a
template name with its ``config``, ``mode`` eager / cuda_graph, measured ``ms``), rebuilds each
site the way the compiler finds it (make_fx + find on a fake group of the row's world size) and
predicts it as the decision would: the template's schedule in the row's launch mode plus, when
host-launched, the profile's host overhead of the template's op (``op_overhead_ms``). Prints the
mean |predicted / measured - 1| per group and overall.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def traced_sites(rows: list[dict]) -> dict:
    """(kind, shape, world) -> Match, each traced once on a fake group of that world size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from overlap_compile.testing.patterns import traced_site

    sites = {}
    for world in sorted({r["world_size"] for r in rows}):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for r in rows:
                key = (r["kind"], tuple(r["shape"]), world)
                if r["world_size"] == world and key not in sites:
                    sites[key] = traced_site(r["kind"], *r["shape"], world)
        finally:
            dist.destroy_process_group()
    return sites


def predict_row(r: dict, match, profile) -> float | None:
    """What the decision would predict for this measured row (None: no model for it)."""
    from overlap_compile import predictor, templates
    from overlap_compile.predictor.models import Ctx, baseline

    ctx = Ctx(mode=r["mode"])
    site = predictor.site_of(match, profile)
    if r["method"] == "sequential":
        sched = baseline(site, profile, ctx)
        return sched.total_ms if sched else None
    spec = templates.get_spec(r["method"])
    sched = predictor.schedule_for(spec, match, r["config"], profile, ctx, site)
    if sched is None:
        return None
    return sched.total_ms + predictor.op_overhead_ms(profile, r["method"], r["mode"])


def replay(rows: list[dict], profile) -> list[tuple[dict, float]]:
    sites = traced_sites(rows)
    out = []
    for r in rows:
        pred = predict_row(r, sites[(r["kind"], tuple(r["shape"]), r["world_size"])], profile)
        if pred is not None:
            out.append((r, pred / r["ms"] - 1))
    return out


def main() -> None:
    from overlap_compile import predictor, templates

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--profile", default="h200")
    args = ap.parse_args()
    known = set(templates.names()) | {"sequential"}
    rows = [r for p in args.results for r in json.load(open(p))
            if r.get("method") in known and r.get("ms") == r.get("ms") and r.get("ms") and r.get("correct", True)]
    errs = replay(rows, predictor.load_profile(args.profile))
    groups: dict[tuple, list[float]] = {}
    for r, e in errs:
        for key in [(r["mode"], "all", "all"), (r["mode"], r["method"], "all"), (r["mode"], r["method"], r["kind"])]:
            groups.setdefault(key, []).append(abs(e))
    print(f"{len(errs)} measured rows replayed against profile {args.profile!r}")
    print(f"{'mode':>10} {'method':>16} {'kind':>20} {'n':>4} {'mean|err|':>9} {'median':>7}")
    for key in sorted(groups):
        v = groups[key]
        print(f"{key[0]:>10} {key[1]:>16} {key[2]:>20} {len(v):>4} {statistics.mean(v):9.1%} {statistics.median(v):7.1%}")


if __name__ == "__main__":
    main()
