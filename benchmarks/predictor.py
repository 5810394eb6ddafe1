"""Predictor calibration: predicted vs measured time for every shape and candidate configuration.

    python benchmarks/predictor.py --world 4 --out $OUT                 # spawns 4 NCCL processes
    torchrun --nproc-per-node 4 benchmarks/predictor.py --out $OUT      # or under torchrun
    python benchmarks/predictor.py --world 2 --kinds gemm_allreduce --limit 2 --profile h200

For each operator shape of shapes.json (gemm_allreduce, gemm_reducescatter, gemm_alltoall,
allgather_gemm) the site is built the way the compiler builds it (the sequential pattern traced
with make_fx, found by passes.find), then:

* the sequential baseline and, per template that supports the site, every configuration its
  ``spec.candidates`` offers (ranked by the predictor) are rewritten into the graph with
  passes.rewrite and timed, host-launched ("eager") and CUDA-graph captured ("cuda_graph"), the
  slowest rank's median; outputs are checked against the baseline in the same run;
* the prediction of the same configuration in the same launch mode (predictor.schedule_for) and
  the overlap bound go next to each measurement;
* "auto": what the predictor decides for the site (run_on_graph with the profile), measured.

Rows follow DESIGN.md's schema (benchmark "predictor") with extra keys ``error`` (predicted /
measured - 1), ``rank_predicted`` and ``site``; they go to
``<out>/predictor-<device>-w<world>-torch<v>-<date>.json`` (benchmarks/results_io.py), with a CDF
plot of |error| (``...-cdf.png``, benchmarks/plot.py) and a table (``...-table.txt``) giving, per
shape and mode: mean |error|, the measured time of the predicted-best configuration over the
measured-best one, and whether the predictor kept the baseline whenever every rewrite measured
slower.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import torch
from torch._inductor import config as inductor_config
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

SHAPE_FILES = [os.path.join(HERE, "..", "..", "shared", "shapes.json"), os.path.join(HERE, "shapes.json")]
KINDS = ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall", "allgather_gemm")


def load_shapes(path: str | None) -> dict:
    for p in ([path] if path else SHAPE_FILES):
        if p and os.path.exists(p):
            with open(p) as f:
                return json.load(f)
    raise SystemExit(f"no shapes.json found (tried {path or SHAPE_FILES}); pass --shapes")


from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import graphed, time_ms  # noqa: E402
from overlap_compile.testing.patterns import gemm_then_collective as sequential_fn  # noqa: E402

WARMUP = 3  # calls before each timing


def inputs_for(kind: str, m: int, n: int, k: int, world: int, rank: int):
    torch.manual_seed(1000 + rank)
    rows = m // world if kind == "allgather_gemm" else m
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) / k ** 0.25
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.25
    return a, b


def traced(kind: str, group: str, world: int, a, b):
    """(GraphModule, Match) of the sequential pattern, as the compiler would find it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlap_compile.passes.find import find

    gm = make_fx(sequential_fn(kind, group, world), tracing_mode="fake")(a, b)
    matches = find(gm.graph)
    if len(matches) != 1 or matches[0].unsupported:
        raise RuntimeError(f"{kind}: expected one supported site, got {[(m.kind, m.unsupported) for m in matches]}")
    return gm, matches[0]


def rewritten_fn(kind: str, group: str, world: int, a, b, template: str, config: dict, timeout_ms: int):
    """The graph with this one site rewritten to (template, config): the op + glue a compiled model runs."""
    from overlap_compile.passes.decide import Decision
    from overlap_compile.passes.rewrite import rewrite

    gm, match = traced(kind, group, world, a, b)
    rewrite(gm.graph, [Decision(match, template, config, "benchmark", [])], timeout_ms)
    gm.recompile()
    return lambda: gm(a, b)


def auto_fn(kind: str, group: str, world: int, a, b, options):
    from overlap_compile.passes.pipeline import run_on_graph

    gm, _ = traced(kind, group, world, a, b)
    record = run_on_graph(gm.graph, options)
    gm.recompile()
    return (lambda: gm(a, b)), record.sites[0]


def rel_err(out, ref) -> float:
    out = out.reshape(ref.shape) if out.numel() == ref.numel() else out
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def out_of_time(deadline: float | None) -> bool:
    """Rank 0's clock decides for every rank (one broadcast), so all ranks stop at the same shape."""
    if deadline is None:
        return False
    flag = torch.tensor([float(time.monotonic() > deadline)], device="cuda")
    dist.broadcast(flag, 0)
    return bool(flag.item())


def bench(kinds, shapes, profile_name: str, iters: int, max_candidates: int, only: list[str] | None,
          time_budget_s: float = 0.0) -> list[dict]:
    from overlap_compile import config as oc_config
    from overlap_compile import predictor, templates
    from overlap_compile.predictor.models import Ctx

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    dev = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    profile = predictor.load_profile(profile_name)
    opts = dataclasses.replace(oc_config.current(), profile=profile_name)
    rows = []
    deadline = time.monotonic() + time_budget_s if time_budget_s else None
    for kind in kinds:
        for shape in shapes.get(kind, []):
            if out_of_time(deadline):
                if rank == 0:
                    print(f"time budget ({time_budget_s:.0f} s) spent: {kind} {shape} and the shapes after it "
                          "were not measured", flush=True)
                return rows
            m, n, k = shape
            a, b = inputs_for(kind, m, n, k, world, rank)
            seq = sequential_fn(kind, group, world)
            ref = seq(a, b)
            _, match = traced(kind, group, world, a, b)
            site_sig = match.signature()
            base = {"benchmark": "predictor", "device": dev, "world_size": world, "torch": torch.__version__,
                    "date": date, "kind": kind, "shape": list(shape), "profile": profile.key, "site": site_sig}
            cands = []  # (template, config, rank_predicted)
            for name in templates.names():
                if only and name not in only:
                    continue
                spec = templates.get_spec(name)
                if spec.supports(match):
                    continue
                ranked = predictor.rank_configs(spec, match, profile, options=opts)
                timed = [c for c in ranked if c.predicted_ms is not None][:max_candidates]
                cands += [(c.template, c.config, i) for i, c in enumerate(timed)]
            for mode in ("eager", "cuda_graph"):
                # the decision depends on the launch mode (host overhead, model error): made in each
                with inductor_config.patch({"triton.cudagraphs": mode == "cuda_graph"}):
                    auto, auto_site = auto_fn(kind, group, world, a, b, opts)
                ctx = Ctx(mode=mode, first_max=opts.wave_group_first_max, last_max=opts.wave_group_last_max)
                site = predictor.site_of(match, profile)
                base_sched = predictor.models.baseline(site, profile, ctx)
                try:
                    seq_call = lambda: seq(a, b)  # noqa: E731
                    seq_ms = time_ms(seq_call if mode == "eager" else graphed(seq_call), iters, WARMUP)
                except Exception as e:
                    seq_ms = float("nan")
                    if rank == 0:
                        print(f"sequential {kind} {shape} {mode}: {type(e).__name__}: {e}", flush=True)
                rows.append({**base, "method": "sequential", "config": None, "mode": mode, "ms": seq_ms,
                             "predicted_ms": base_sched.total_ms, "bound_ms": base_sched.bound_ms,
                             "error": base_sched.total_ms / seq_ms - 1 if seq_ms == seq_ms else None,
                             "rank_predicted": None, "correct": True})
                for template, cfg, rank_pred in cands:
                    spec = templates.get_spec(template)
                    sched = predictor.schedule_for(spec, match, cfg, profile, ctx, site)
                    try:
                        fn = rewritten_fn(kind, group, world, a, b, template, cfg, opts.signal_timeout_ms)
                        err = rel_err(fn(), ref)
                        ms = time_ms(fn if mode == "eager" else graphed(fn), iters, WARMUP)
                    except Exception as e:  # reported, never hidden
                        ms, err = float("nan"), float("nan")
                        if rank == 0:
                            print(f"{template} {cfg} {kind} {shape} {mode}: {type(e).__name__}: {e}", flush=True)
                    pred = sched.total_ms if sched else None
                    rows.append({**base, "method": template, "config": cfg, "mode": mode, "ms": ms,
                                 "predicted_ms": pred, "bound_ms": sched.bound_ms if sched else None,
                                 "error": (pred / ms - 1) if pred is not None and ms == ms else None,
                                 "rank_predicted": rank_pred, "correct": bool(err < 2e-2), "rel_err": err})
                try:
                    ams = time_ms(auto if mode == "eager" else graphed(auto), iters, WARMUP)
                    aerr = rel_err(auto(), ref)
                except Exception as e:
                    ams, aerr = float("nan"), float("nan")
                    if rank == 0:
                        print(f"auto {kind} {shape} {mode}: {type(e).__name__}: {e}", flush=True)
                rows.append({**base, "method": "auto", "config": {"template": auto_site.template,
                                                                   "config": auto_site.config},
                             "mode": mode, "ms": ams, "predicted_ms": auto_site.predicted_ms.get(
                                 _label(auto_site), None), "reason": auto_site.reason,
                             "correct": bool(aerr < 2e-2), "rel_err": aerr})
            if rank == 0:
                print(summary_table([r for r in rows if r["kind"] == kind and r["shape"] == list(shape)]), flush=True)
    return rows


def _label(site) -> str:
    if site.template == "baseline":
        return "baseline"
    for key in site.predicted_ms:
        if key.startswith(site.template):
            return key
    return site.template


def summarize(rows: list[dict]) -> list[dict]:
    """Per (kind, shape, mode): mean |error|, predicted-best vs measured-best, baseline kept when right."""
    out = []
    keys = sorted({(r["kind"], tuple(r["shape"]), r["mode"]) for r in rows})
    for kind, shape, mode in keys:
        rs = [r for r in rows if (r["kind"], tuple(r["shape"]), r["mode"]) == (kind, shape, mode)]
        seq = next((r for r in rs if r["method"] == "sequential"), None)
        cands = [r for r in rs if r["method"] not in ("sequential", "auto") and r["ms"] == r["ms"] and r["correct"]]
        errs = [abs(r["error"]) for r in rs if r.get("error") is not None and r["method"] != "auto"]
        entry = {"kind": kind, "shape": list(shape), "mode": mode,
                 "mean_abs_error": statistics.mean(errs) if errs else None, "n": len(errs)}
        if cands:
            best = min(cands, key=lambda r: r["ms"])
            chosen = min(cands, key=lambda r: r["predicted_ms"] if r["predicted_ms"] is not None else float("inf"))
            entry["best_measured"] = {"method": best["method"], "config": best["config"], "ms": best["ms"]}
            entry["predicted_best"] = {"method": chosen["method"], "config": chosen["config"], "ms": chosen["ms"]}
            entry["best_over_chosen"] = best["ms"] / chosen["ms"]
            if seq is not None and seq["ms"] == seq["ms"]:
                all_slower = all(r["ms"] >= seq["ms"] for r in cands)
                auto = next((r for r in rs if r["method"] == "auto"), None)
                kept = auto is not None and auto["config"]["template"] == "baseline"
                entry["all_rewrites_slower"] = all_slower
                entry["auto_kept_baseline"] = kept
                entry["auto_ok"] = (not all_slower) or kept
                if kept:  # the same graph as the sequential row: two timings of it differ by noise only
                    entry["auto_vs_sequential"] = 1.0
                    entry["best_over_auto"] = min([seq["ms"]] + [r["ms"] for r in cands]) / seq["ms"]
                    entry["auto_noise"] = seq["ms"] / auto["ms"] if auto["ms"] == auto["ms"] else None
                elif auto is not None and auto["ms"] == auto["ms"]:
                    entry["auto_vs_sequential"] = seq["ms"] / auto["ms"]
                    # the exhaustive best over everything (baseline included) vs what the predictor picked
                    entry["best_over_auto"] = min([seq["ms"]] + [r["ms"] for r in cands]) / auto["ms"]
        out.append(entry)
    return out


def summary_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cfg = "" if not r.get("config") else json.dumps(r["config"], separators=(",", ":"))[:60]
        pred = f"{r['predicted_ms']:.3f}" if r.get("predicted_ms") is not None else "-"
        err = f"{r['error']:+.1%}" if r.get("error") is not None else "-"
        lines.append(f"{r['kind']:>18} {str(r['shape']):>20} {r['mode']:>10} {r['method']:>16} "
                     f"{r['ms']:8.3f} ms  pred {pred:>7}  err {err:>7}  {cfg}")
    return "\n".join(lines)


def write_outputs(rows: list[dict], out_dir: str, dev: str, world: int) -> list[str]:
    date = datetime.date.today().isoformat()
    stem = os.path.splitext(write_rows(rows, out_dir, "predictor", dev, world, date=date, default=str))[0]
    summ = summarize(rows)
    errs = [abs(r["error"]) for r in rows if r.get("error") is not None and r["method"] != "auto"]
    lines = [f"predictor calibration on {dev}, world {world}, {date}: {len(errs)} predictions",
             f"mean |error| {statistics.mean(errs):.1%}, median {statistics.median(errs):.1%}, "
             f"max {max(errs):.1%}" if errs else "no predictions measured"]
    ratios = [s["best_over_chosen"] for s in summ if "best_over_chosen" in s]
    if ratios:
        lines.append(f"predicted-best config measures {min(ratios):.3f} (worst) / {statistics.mean(ratios):.3f} (mean) "
                     f"as fast as the measured best (target >= 0.98)")
    autos = [s["best_over_auto"] for s in summ if "best_over_auto" in s]
    if autos:
        lines.append(f"the predictor's decision (baseline included) measures {min(autos):.3f} (worst) / "
                     f"{statistics.mean(autos):.3f} (mean) as fast as the best measured option")
    bad = [s for s in summ if s.get("auto_ok") is False]
    lines.append("whenever every rewrite measured slower, the predictor kept the baseline"
                 if not bad else
                 f"{len(bad)} shape/mode(s) where every rewrite was slower but the predictor rewrote: " +
                 "; ".join(f"{s['kind']} {s['shape']} {s['mode']}" for s in bad))
    lost = [s for s in summ if s.get("auto_vs_sequential", 1) < 1]
    if lost:
        lines.append("shapes where the predictor's choice lost to the baseline: " +
                     "; ".join(f"{s['kind']} {s['shape']} {s['mode']} ({s['auto_vs_sequential']:.3f}x)" for s in lost))
    lines.append("")
    lines.append(f"{'kind':>18} {'shape':>20} {'mode':>10} {'n':>3} {'mean|err|':>9} {'best/chosen':>11} {'auto x':>7}")
    for s in summ:
        mae = f"{s['mean_abs_error']:.1%}" if s["mean_abs_error"] is not None else "-"
        boc = f"{s['best_over_chosen']:.3f}" if "best_over_chosen" in s else "-"
        ax = f"{s['auto_vs_sequential']:.3f}" if "auto_vs_sequential" in s else "-"
        lines.append(f"{s['kind']:>18} {str(s['shape']):>20} {s['mode']:>10} {s['n']:>3} {mae:>9} {boc:>11} {ax:>7}")
    with open(stem + "-table.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    paths = [stem + ".json", stem + "-table.txt"]
    try:
        from benchmarks.plot import plot_error_cdf

        paths.append(plot_error_cdf(rows, stem + "-cdf.png", f"predictor error, {dev}, W={world}"))
    except ImportError:
        print("matplotlib not installed: no CDF plot")
    return paths


def worker(kinds, shapes, profile, iters, max_candidates, only, out_dir, time_budget_s=0.0):
    rows = bench(kinds, shapes, profile, iters, max_candidates, only, time_budget_s)
    if dist.get_rank() == 0 and out_dir:
        for p in write_outputs(rows, out_dir, torch.cuda.get_device_name(), dist.get_world_size()):
            print("wrote", p)
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--limit", type=int, default=0, help="first N shapes of each kind (0 = all)")
    ap.add_argument("--profile", default="auto", help="predictor profile: auto, a built-in name, or a JSON path")
    ap.add_argument("--templates", default=None, help="comma list (default: every implemented template)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--max-candidates", type=int, default=64, help="per template, best predicted first")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds; no new shape starts after this (0 = no limit); the table says what was skipped")
    args = ap.parse_args()
    shapes = load_shapes(args.shapes)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.limit:
        shapes = {k: shapes.get(k, [])[: args.limit] for k in kinds}
    only = args.templates.split(",") if args.templates else None
    wargs = (kinds, shapes, args.profile, args.iters, args.max_candidates, only, args.out, args.time_budget)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        worker(*wargs)
        from overlap_compile.runtime import teardown

        teardown.finish()  # barrier, then destroy_process_group, every rank before the store's host leaves
        return
    if args.world < 2:
        raise SystemExit("benchmarks/predictor.py needs 2+ CUDA GPUs")
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=args.world, args=wargs, backend="nccl", timeout_s=3000)


if __name__ == "__main__":
    main()
