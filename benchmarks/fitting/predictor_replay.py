"""Replay measured runs against a profile on CPU: how far off is the predictor, per mode, kind and
method, and would it have picked the fastest measured configuration -- without a GPU.

    python benchmarks/fitting/predictor_replay.py [benchmarks/results/predictor-*.json ...] --profile h200

Reads rows of ``benchmarks/predictor.py`` / ``benchmarks/ops.py`` (method ``sequential`` or a
template name with its ``config``, ``mode`` eager / cuda_graph, measured ``ms``; without files:
every committed H200 run), rebuilds each site the way the compiler finds it (make_fx + find on a
fake group of the row's world size) and predicts it as the decision would: the template's schedule
in the row's launch mode plus, when host-launched, the profile's host overhead of the template's
op (``op_overhead_ms``). Prints, per group:

* the mean signed error (predicted / measured - 1: > 0 pessimistic, < 0 optimistic) next to the
  mean and median |error|, so a bias shows apart from the scatter;
* best / chosen: per (kind, shape, world, mode), the measured time of the fastest measured
  configuration over the measured time of the one the predictor ranks first (1.0: it picked the
  fastest), within each template and for the decision among all of them and the baseline (both
  the plain argmin and decide()'s rule, which needs min_speedup x (1 + model_error)).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")  # benchmarks/results
# The first run of each template's GPU kernels: rows measured before it ran the Python reference
# (torch.distributed send/recv from Python, 0.04-0.12x of sequential), which no model describes.
GPU_PATH_SINCE = {"p2p_ring": "2026-11-23"}
# host-launched template ops replay a CUDA graph per call (runtime.op_graphs, on by default) in the
# runs since this date; earlier rows launched them piece by piece
OP_GRAPHS_SINCE = "2026-11-25"


# Rows timing a kernel that has since been replaced: (method, kind, transport) -> the result files
# measured with the old kernel. p2p_ring's copy-engine reduce-scatter summed the partials in four
# torch passes until 8d8f7ca (templates/p2p_ring/sum_kernel.py: one pass); the model describes
# the kernel in the tree.
SUPERSEDED = {("p2p_ring", "gemm_reducescatter", "p2p"): {
    "ops-NVIDIA_H200-w2-torch2.11.0-2026-11-23-p2p_ring.json",
    "ops-NVIDIA_H200-w2-torch2.11.0-2026-11-23-p2p_ring-ag.json",
    "predictor-NVIDIA_H200-w2-torch2.11.0-2026-11-23.json"}}


def committed_results() -> list[str]:
    """Every committed H200 run that timed templates against sequential (ops.py, predictor.py).
    Files git does not track yet are left out: they may time kernels the models do not describe
    yet (when git is not at hand, every file there)."""
    paths = sorted(p for bench in ("ops", "predictor")
                   for p in glob.glob(os.path.join(RESULTS, f"{bench}-NVIDIA_H200-w*.json")))
    try:
        out = subprocess.run(["git", "ls-files", "--", RESULTS], capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(RESULTS)).stdout
    except (OSError, subprocess.CalledProcessError):
        return paths
    tracked = {os.path.basename(line) for line in out.splitlines()}
    return [p for p in paths if os.path.basename(p) in tracked]


def ran_reference(r: dict) -> bool:
    """True for a row that timed a template's Python reference instead of its GPU kernels: before
    its GPU path existed, or (p2p_ring) an NCCL-transport config that only the reference runs
    (templates/p2p_ring/spec.py: sliced or bidirectional)."""
    if r["method"] in GPU_PATH_SINCE and r.get("date", "") < GPU_PATH_SINCE[r["method"]]:
        return True
    cfg = r.get("config") or {}
    return r["method"] == "p2p_ring" and cfg.get("transport") == "nccl" and (
        int(cfg.get("slices", 1)) != 1 or bool(cfg.get("bidirectional")))


def superseded(r: dict, path: str) -> bool:
    transport = (r.get("config") or {}).get("transport")
    return os.path.basename(path) in SUPERSEDED.get((r["method"], r["kind"], transport), ())


def as_template_row(r: dict) -> dict:
    """An ops.py ``auto`` row as the row of the template it ran (``config.chosen`` and the rest of
    its config), so the predictor is replayed on what auto chose; other rows as they are."""
    chosen = (r.get("config") or {}).get("chosen") if r.get("method") == "auto" else None
    if chosen is None:
        return r
    cfg = {k: v for k, v in r["config"].items() if k != "chosen"}
    return {**r, "method": "sequential", "config": None} if chosen == "baseline" else {**r, "method": chosen,
                                                                                     "config": cfg}


def load_rows(paths: list[str]) -> list[dict]:
    """The measured rows a model describes: a known method, a finite time, a correct result, the
    template's GPU path as it is in the tree."""
    from overlap_compile import templates

    known = set(templates.names()) | {"sequential"}
    rows = []
    for p in paths:
        for r in map(as_template_row, json.load(open(p))):
            ok = r.get("method") in known and r.get("ms") == r.get("ms") and r.get("ms") and r.get("correct", True)
            if ok and not ran_reference(r) and not superseded(r, p):
                rows.append(r)
    return rows


def traced_sites(rows: list[dict]) -> dict:
    """(kind, shape, world) -> Match, each traced once on a fake group of that world size."""
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site

    sites = {}
    for world in sorted({r["world_size"] for r in rows}):
        with fake_process_group(world):
            for r in rows:
                key = (r["kind"], tuple(r["shape"]), world)
                if r["world_size"] == world and key not in sites:
                    sites[key] = traced_site(r["kind"], *r["shape"], world)
    return sites


def predict_row(r: dict, match, profile) -> float | None:
    """What the decision would predict for this measured row (None: no model for it)."""
    from overlap_compile import predictor, templates
    from overlap_compile.predictor.models import Ctx, baseline

    ctx = Ctx(mode=r["mode"])
    site = predictor.site_of(match, profile)
    host = predictor.site_host_ms(profile, r["mode"])
    if r["method"] == "sequential":
        sched = baseline(site, profile, ctx)
        return sched.total_ms + host if sched else None
    sched, host = predictor.price_config(templates.get_spec(r["method"]), match, r["config"], profile, ctx, site,
                                         r.get("date", "") >= OP_GRAPHS_SINCE)
    return sched.total_ms + host if sched is not None else None


def predictions(rows: list[dict], profile, sites: dict | None = None) -> list[tuple[dict, float]]:
    """(row, predicted ms) for every row that has a model."""
    sites = sites if sites is not None else traced_sites(rows)
    out = []
    for r in rows:
        pred = predict_row(r, sites[(r["kind"], tuple(r["shape"]), r["world_size"])], profile)
        if pred is not None:
            out.append((r, pred))
    return out


def replay(rows: list[dict], profile, sites: dict | None = None) -> list[tuple[dict, float]]:
    """(row, predicted / measured - 1) for every row that has a model."""
    return [(r, pred / r["ms"] - 1) for r, pred in predictions(rows, profile, sites)]


# ---- error tables ------------------------------------------------------------------------------


def error_groups(errs: list[tuple[dict, float]]) -> dict[tuple, list[float]]:
    """(mode, method, kind) -> signed errors, with "all" rolled up per mode and per method."""
    groups: dict[tuple, list[float]] = {}
    for r, e in errs:
        for key in [(r["mode"], "all", "all"), (r["mode"], r["method"], "all"), (r["mode"], r["method"], r["kind"])]:
            groups.setdefault(key, []).append(e)
    return groups


def mean_abs(errs: list[tuple[dict, float]], mode: str, templates_only: bool = False) -> float:
    v = [abs(e) for r, e in errs if r["mode"] == mode and not (templates_only and r["method"] == "sequential")]
    return statistics.mean(v) if v else float("nan")


def print_errors(errs: list[tuple[dict, float]]) -> None:
    print(f"{'mode':>10} {'method':>16} {'kind':>20} {'n':>4} {'signed':>7} {'mean|e|':>7} {'med|e|':>7}")
    for key, v in sorted(error_groups(errs).items()):
        a = [abs(e) for e in v]
        print(f"{key[0]:>10} {key[1]:>16} {key[2]:>20} {len(v):>4} {statistics.mean(v):+7.1%} "
              f"{statistics.mean(a):7.1%} {statistics.median(a):7.1%}")


# ---- best / chosen -----------------------------------------------------------------------------


def _by_site(preds: list[tuple[dict, float]]) -> dict[tuple, dict[tuple, tuple[float, float]]]:
    """(kind, shape, world, mode) -> {(method, config): (measured ms, predicted ms)}; a config
    measured in several runs keeps its best time (as tests/test_decide_measured.py does)."""
    out: dict[tuple, dict[tuple, tuple[float, float]]] = {}
    for r, pred in preds:
        site = (r["kind"], tuple(r["shape"]), r["world_size"], r["mode"])
        cand = (r["method"], json.dumps(r.get("config"), sort_keys=True) if r["method"] != "sequential" else "")
        seen = out.setdefault(site, {}).get(cand)
        out[site][cand] = (min(r["ms"], seen[0]) if seen else r["ms"], pred)
    return out


def _ratio(cands: dict[tuple, tuple[float, float]], chosen: tuple) -> float:
    """Fastest measured / measured of the chosen: 1.0 when the choice is the fastest."""
    return min(ms for ms, _ in cands.values()) / cands[chosen][0]


def decide_rule(cands: dict[tuple, tuple[float, float]], needed: float) -> tuple:
    """decide()'s choice among measured candidates: the best predicted rewrite if the baseline's
    prediction over it reaches ``needed`` (min_speedup x (1 + model_error)), else the baseline."""
    base = next(c for c in cands if c[0] == "sequential")
    rewrites = [c for c in cands if c[0] != "sequential"]
    if not rewrites:
        return base
    best = min(rewrites, key=lambda c: cands[c][1])
    return best if cands[base][1] / cands[best][1] >= needed else base


def best_chosen(preds: list[tuple[dict, float]], needed: dict[str, float]) -> dict[tuple, list[float]]:
    """(mode, what) -> ratios per site: what = a template (its own configs only), "argmin" (every
    measured candidate and the baseline, fastest predicted), "decide" (decide_rule)."""
    out: dict[tuple, list[float]] = {}
    for (kind, shape, world, mode), cands in sorted(_by_site(preds).items()):
        for method in sorted({m for m, _ in cands} - {"sequential"}):
            own = {c: v for c, v in cands.items() if c[0] == method}
            if len(own) > 1:  # a single measured config has nothing to choose between
                out.setdefault((mode, method), []).append(_ratio(own, min(own, key=lambda c: own[c][1])))
        if not any(c[0] == "sequential" for c in cands):
            continue
        out.setdefault((mode, "argmin"), []).append(_ratio(cands, min(cands, key=lambda c: cands[c][1])))
        out.setdefault((mode, "decide"), []).append(_ratio(cands, decide_rule(cands, needed[mode])))
    return out


def print_best_chosen(ratios: dict[tuple, list[float]]) -> None:
    print(f"{'mode':>10} {'chosen among':>16} {'sites':>5} {'mean':>6} {'min':>6} {'<0.98':>5}")
    for (mode, what), v in sorted(ratios.items()):
        print(f"{mode:>10} {what:>16} {len(v):>5} {statistics.mean(v):6.3f} {min(v):6.3f} "
              f"{sum(x < 0.98 for x in v):>5}")


# ---- per-template bars: evaluated, not adopted (README) -------------------------------------------

GAIN_QUANTILE = 0.8
SHRINK_ROWS = 8  # a template/kind with n measured sites counts n / (n + 8) of its own quantile


def gain_overpromise(sites: dict) -> dict[tuple, list[float]]:
    """(mode, template, kind) -> predicted gain / measured gain - 1 per measured site and config
    (> 0: the predictor promised more than the rewrite gave)."""
    out: dict[tuple, list[float]] = {}
    for (kind, _shape, _world, mode), cands in sites.items():
        base = next((c for c in cands if c[0] == "sequential"), None)
        if base is None:
            continue
        mb, pb = cands[base]
        for c, (mt, pt) in cands.items():
            if c[0] != "sequential":
                out.setdefault((mode, c[0], kind), []).append((pb / pt) / (mb / mt) - 1)
    return out


def _quantile(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, max(0, int(round(p * (len(v) - 1)))))]


def template_bars(sites: dict, min_speedup: float) -> dict[tuple, float]:
    """(mode, template, kind) -> the gain a rewrite would need: min_speedup x (1 + the shrunk
    GAIN_QUANTILE of its over-promise); (mode, "all", "all") for templates/kinds not measured."""
    over = gain_overpromise(sites)
    bars = {}
    for mode in ("eager", "cuda_graph"):
        pooled = [e for (m, _, _), v in over.items() if m == mode for e in v]
        q_mode = max(0.0, _quantile(pooled, GAIN_QUANTILE)) if pooled else 0.0
        bars[(mode, "all", "all")] = min_speedup * (1 + q_mode)
        for (m, t, k), v in over.items():
            if m == mode:
                q = (len(v) * _quantile(v, GAIN_QUANTILE) + SHRINK_ROWS * q_mode) / (len(v) + SHRINK_ROWS)
                bars[(mode, t, k)] = min_speedup * (1 + max(0.0, q))
    return bars


def decide_per_template(cands: dict[tuple, tuple[float, float]], bars: dict[tuple, float], mode: str,
                        kind: str) -> tuple:
    """The fastest predicted rewrite among those clearing their own template's bar, else the baseline."""
    base = next(c for c in cands if c[0] == "sequential")
    ok = [c for c in cands if c[0] != "sequential" and cands[base][1] / cands[c][1]
          >= bars.get((mode, c[0], kind), bars[(mode, "all", "all")])]
    return min(ok, key=lambda c: cands[c][1]) if ok else base


def compare_bars(preds: list[tuple[dict, float]], needed: dict[str, float], min_speedup: float) -> None:
    """decide()'s bar against per-template bars, fitted on one world size and tested on the other:
    best/chosen per site, sites under 0.98, rewrites, losses (a rewrite measured slower)."""
    sites = _by_site(preds)
    print(f"{'fit':>4} {'test':>4} {'mode':>10} {'rule':>13} {'sites':>5} {'best/chosen':>11} {'<0.98':>5} "
          f"{'rewritten':>9} {'losses':>6}")
    worlds = sorted({k[2] for k in sites})
    for fit in worlds:
        for test in worlds:
            if fit == test:
                continue
            bars = template_bars({k: v for k, v in sites.items() if k[2] == fit}, min_speedup)
            held = {k: v for k, v in sites.items() if k[2] == test and any(c[0] == "sequential" for c in v)}
            for mode in ("cuda_graph", "eager"):
                for name, rule in (("model_error", lambda c, m, k: decide_rule(c, needed[m])),
                                   ("per-template", lambda c, m, k: decide_per_template(c, bars, m, k))):
                    ratios, rewritten, losses = [], 0, 0
                    for (kind, _s, _w, m), cands in held.items():
                        if m != mode:
                            continue
                        base = next(c for c in cands if c[0] == "sequential")
                        chosen = rule(cands, m, kind)
                        ratios.append(_ratio(cands, chosen))
                        rewritten += chosen != base
                        losses += chosen != base and cands[chosen][0] > cands[base][0]
                    if ratios:
                        print(f"{fit:>4} {test:>4} {mode:>10} {name:>13} {len(ratios):>5} {statistics.mean(ratios):11.3f} "
                              f"{sum(r < 0.98 for r in ratios):>5} {rewritten:>9} {losses:>6}")


def needed_gain(profile) -> dict[str, float]:
    from overlap_compile import config
    from overlap_compile.passes.decide import required_gain

    return {m: required_gain(config.current(), profile, m) for m in ("eager", "cuda_graph")}


def main() -> None:
    from overlap_compile import predictor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", help="result JSON files (default: every committed H200 run)")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--rows", action="store_true", help="also print every row's prediction")
    ap.add_argument("--compare-bars", action="store_true",
                    help="also compare decide()'s bar with per-template bars, held out by world size")
    args = ap.parse_args()
    profile = predictor.load_profile(args.profile)
    rows = load_rows(args.results or committed_results())
    preds = predictions(rows, profile)
    errs = [(r, p / r["ms"] - 1) for r, p in preds]
    if args.rows:
        for r, p in preds:
            print(f"{r['mode']:>10} {r['method']:>16} {r['kind']:>18} {r['world_size']} {str(r['shape']):>20} "
                  f"{json.dumps(r.get('config'), sort_keys=True)[:60]:<60} meas {r['ms']:.4f} pred {p:.4f} "
                  f"{p / r['ms'] - 1:+.1%}")
    print(f"{len(errs)} measured rows replayed against profile {args.profile!r}")
    print_errors(errs)
    print("\nbest/chosen: fastest measured / measured of the predicted-best (per site)")
    print_best_chosen(best_chosen(preds, needed_gain(profile)))
    if args.compare_bars:
        from overlap_compile import config

        print("\nbars: decide()'s min_speedup x (1 + model_error) vs per-template bars (fit on one world size)")
        compare_bars(preds, needed_gain(profile), config.current().min_speedup)


if __name__ == "__main__":
    main()
