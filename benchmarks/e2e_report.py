"""What the end-to-end benchmark (benchmarks/e2e.py) makes of its rows: one printed line per row,
the comparisons with the default variant and the nocomm bound (speedups, share of the gap
closed, loss check), the markdown table, the run's verdict, and the files: the rows
(benchmarks/results_io.py), the table and the PNGs (benchmarks/plot.py), and rank 0's running
record of a run that may be cut off.
"""
from __future__ import annotations

import json
import os
import statistics

from benchmarks.results_io import write_rows

# options on by default whose share of the gain a run can isolate by turning one off: option ->
# the suffix of that run's results file where the option differs from the backend's default: the
# name on, "no" + the name off (run_multigpu.sh's E2E_DEFER_ARGS / E2E_NOSETTLE_ARGS)
ATTRIBUTION = {"defer_compute": "defer", "measure_uncertain": "settle", "prioritize_deferred": "prioritize"}


def one_line(r: dict) -> str:
    if "check" in r:
        res = f"max rel {r['max_rel']:.2e} (tol {r['tol']:g})" if "max_rel" in r else "ERROR " + r.get("error", "")[:160]
        return f"{'check':>15} {r['shape'][:34]:>34}  {r['check']}: {res} -> {'OK' if r.get('correct') else 'FAIL'}"
    head = (f"{r.get('model', '-'):>15} {r.get('shape', '-')[:40]:>40} {r.get('compile_mode', '-'):>15} "
            f"{r.get('variant', '-'):>9}")
    if "error" in r:
        return head + f"  ERROR [{r.get('failure', 'error')}] " + r["error"].splitlines()[0][:160]
    if "skipped" in r:
        return head + "  skipped: " + r["skipped"]
    fmt = lambda k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    extra = f"  rewritten {r['rewritten']}/{len(r['sites'])}, pass {r['pass_s']:.2f} s" if "sites" in r else ""
    extra += f"  collectives replaced {sum(r['nocomm_replaced'].values())}" if "nocomm_replaced" in r else ""
    calls = r.get("op_graph_calls") or {}
    extra += f"  op replays {calls.get('replayed', 0)}/{sum(calls.values())}" if sum(calls.values()) else ""
    if "seq" in r:
        extra += (f"  seq {r['seq']} {'dynamic' if r['dynamic'] else 'static'}, compiles {r.get('compiles')}, "
                  f"max rel {r.get('max_rel', float('nan')):.1e}")
    modes = f"  [{', '.join(r['failure_modes'])}]" if r.get("failure_modes") else ""
    loss = f"{r['losses'][-1]:.6f}" if r.get("losses") else "-"
    cold = f" (cold {r['train_cold_ms']:.3f})" if "train_cold_ms" in r else ""
    return (head + f"  train {fmt('train_ms', '8.3f')} ms{cold}  prefill {fmt('prefill_ms', '8.3f')} ms  "
            f"compile {fmt('compile_s', '6.1f')} s  loss[-1] {loss}{extra}{modes}")


def speedup(d: dict, r: dict, k: str) -> float:
    """``r``'s speedup over ``d`` in phase ``k`` ("train_ms", ...): the median of the rounds' own
    ratios where the two were timed side by side (``--interleave``: both rows name the same group
    and carry a sample per round), else the ratio of their medians."""
    rounds = f"{k[:-3]}_ms_rounds"
    side = d.get("interleaved") and d.get("interleaved") == r.get("interleaved") \
        and len(d.get(rounds) or ()) == len(r.get(rounds) or ()) > 0
    if side:
        return statistics.median(x / y for x, y in zip(d[rounds], r[rounds]))
    return d[k] / r[k]


def compare(rows: list[dict], loss_rtol: float) -> list[dict]:
    """Speedups over the default variant of the same configuration (``speedup``), the share of the
    gap to the nocomm bound closed (from the two speedups), and the loss check (not for the bounds: without communication, or without
    the padding, their numbers differ)."""
    from benchmarks.plot import E2E_BOUNDS, gap_closed

    key = lambda r: (r["model"], r["shape"], r["compile_mode"], r["ckpt"])  # noqa: E731
    measured = [r for r in rows if "ms" in r]
    default = {key(r): r for r in measured if r["variant"] == "default"}
    bound = {key(r): r for r in measured if r["variant"] == "nocomm"}
    for r in measured:
        d = default.get(key(r))
        if d is None or r is d:
            continue
        b = bound.get(key(r))
        for k in ("train_ms", "train_cold_ms", "prefill_ms"):
            if k in r and k in d:
                r[k.replace("_ms", "_speedup")] = speedup(d, r, k)
                if b is not None and k in b and r["variant"] not in E2E_BOUNDS:
                    # in units of torch.compile's time: (1 - 1/s) / (1 - 1/s_bound)
                    r[k.replace("_ms", "_gap_closed")] = gap_closed(1.0, 1 / r[k.replace("_ms", "_speedup")],
                                                                    1 / speedup(d, b, k))
        if r.get("sites"):  # what the pass predicted it hides of the sites' collectives, per phase
            from overlap_compile.predictor.profile import builtin_for_device
            from overlap_compile.report import forecast

            profile = builtin_for_device(str(r.get("device", "")))
            for phase in ("train", "prefill"):
                sites = [s for s in r["sites"] if s.get("phase") == phase]
                if sites:
                    fc = forecast(sites, profile, r.get("world_size"), r.get("dtype"))["all"]
                    # of the sites' collectives; and of the gap to the nocomm bound (its stand-in copies
                    # off the collectives' time), the forecast of "gap closed"
                    r[f"{phase}_forecast_hidden"] = fc["hidden_share"]
                    r[f"{phase}_forecast_gap"] = fc["gap_share"]
        if d.get("compile_s") and "compile_s" in r:
            r["compile_overhead"] = r["compile_s"] / d["compile_s"] - 1
        if r.get("losses") and d.get("losses") and r["variant"] not in E2E_BOUNDS:
            rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(r["losses"], d["losses"]))
            r["loss_max_rel_diff"] = rel
            r["loss_matches_default"] = r["correct"] = rel <= loss_rtol
            r["loss_rtol"] = loss_rtol
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | shape | compile mode | variant | train ms | x default | tokens/s | prefill ms | x default | "
             "gap closed train/prefill | predicted hidden train/prefill | compile s | pass s | FX cache hits | "
             "loss = default | sites rewritten | failure modes |",
             "|" + "---|" * 17]
    for r in rows:
        if "check" in r:
            continue
        head = f"| {r.get('model', '-')} | {r.get('shape', '-')} | {r.get('compile_mode', '-')} | {r.get('variant', '-')} |"
        if "ms" not in r:
            what = f"ERROR [{r.get('failure')}] {r['error']}" if "error" in r else f"skipped: {r.get('skipped', '')}"
            lines.append(head + f" {what.splitlines()[0][:100]} ||||||||||||")
            continue
        f = lambda k, spec: format(r[k], spec) if r.get(k) is not None else "-"  # noqa: E731
        sites = f"{r['rewritten']}/{len(r['sites'])}" if "sites" in r else "-"
        gap = f"{f('train_gap_closed', '.0%')} / {f('prefill_gap_closed', '.0%')}"
        hidden = f"{f('train_forecast_hidden', '.0%')} / {f('prefill_forecast_hidden', '.0%')}"
        lines.append(head + f" {f('train_ms', '.3f')} | {f('train_speedup', '.3f')} | {f('tokens_per_s', '.3g')} | "
                     f"{f('prefill_ms', '.3f')} | {f('prefill_speedup', '.3f')} | {gap} | {hidden} | {f('compile_s', '.1f')} | "
                     f"{f('pass_s', '.2f')} | {r.get('fxgraph_cache_hit', '-')} | {r.get('loss_matches_default', '-')} | {sites} | "
                     f"{', '.join(r.get('failure_modes', [])) or '-'} |")
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict], rtol: float) -> tuple[bool, list[str]]:
    """The run's self-check: the model check and every loss comparison must hold."""
    notes, ok = [], True
    for r in rows:
        if "check" in r:
            ok &= bool(r.get("correct"))
            notes.append(one_line(r).strip())
    compared = [r for r in rows if "loss_matches_default" in r]
    bad = [r for r in compared if not r["loss_matches_default"]]
    ok &= not bad
    notes.append(f"losses: {len(compared) - len(bad)}/{len(compared)} variants match the default's (rtol {rtol})")
    notes += [f"  MISMATCH {r['model']} {r['shape']} {r['compile_mode']} {r['variant']}: max rel diff "
              f"{r['loss_max_rel_diff']:.2e}" for r in bad]
    outputs = [r for r in rows if "seq" in r and r.get("correct") is not None]  # --seqs: each length vs eager
    wrong = [r for r in outputs if not r["correct"]]
    ok &= not wrong
    if outputs:
        notes.append(f"prefill outputs at each length: {len(outputs) - len(wrong)}/{len(outputs)} equal eager's")
        notes += [f"  MISMATCH {r['model']} {r['shape']} {r['compile_mode']} {r['variant']}: max rel "
                  f"{r['max_rel']:.2e} (rtol {r['out_rtol']})" for r in wrong]
    errors = [r for r in rows if "error" in r and "check" not in r]
    skipped = [r for r in rows if "skipped" in r]
    modes = [r for r in rows if r.get("failure_modes")]
    notes.append(f"errors: {len(errors)}, skipped: {len(skipped)} ({sum('time budget' in r['skipped'] for r in skipped)} "
                 f"for the time budget), runs with failure modes: {len(modes)}")
    notes += [f"  ERROR {r.get('model', '-')} {r.get('shape', '')} {r.get('compile_mode', '')} {r.get('variant', '')}: "
              f"[{r.get('failure')}] {r['error'].splitlines()[0][:120]}" for r in errors]
    return ok, notes


def write(rows: list[dict], out: str) -> str:
    first = rows[0]
    tags = [("" if value else "no") + tag for name, tag in ATTRIBUTION.items()
             for value in (True, False) if any((r.get("config") or {}).get(name) is value for r in rows)]
    path = write_rows(rows, out, "e2e", first["device"], first["world_size"], first["torch"], first["date"],
                      suffix="".join(f"-{tag}" for tag in tags))
    stem = os.path.splitext(path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(rows))
    try:  # the common plotter: train step (ms) and prefill speedups over inductor
        from benchmarks import plot

        for metric, suffix in (("ms", "-train"), ("prefill_ms", "-prefill")):
            for p in plot.plot(rows, out, os.path.basename(stem) + suffix, metric=metric):
                print("wrote", p)
        # absolute times with the nocomm bound; then the whole run in one figure, relative to inductor
        for p in plot.plot_e2e(rows, out, os.path.basename(stem)) + plot.plot_e2e_summary(rows, out, os.path.basename(stem)):
            print("wrote", p)
    except ImportError as e:
        print(f"no plots ({e})")
    return stem


def run_file(out: str, run_id: str, what: str) -> str:
    """e2e's running record (results_io.run_file): 'partial' or 'inflight' (removed when the
    configuration ends)."""
    from benchmarks import results_io

    return results_io.run_file(out, "e2e", run_id, what)


def read_partial(out: str, run_id: str) -> tuple[list[dict], dict | None]:
    """The rows rank 0 wrote before the run was stopped, and the configuration it was inside."""
    path = run_file(out, run_id, "partial")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    inflight = run_file(out, run_id, "inflight")
    cfg = None
    if os.path.exists(inflight):
        with open(inflight) as f:
            cfg = json.load(f)
    return rows, cfg
