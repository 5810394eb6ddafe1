"""The forecast (``overlap_compile.report.forecast``) against what e2e.py measured, from e2e result
rows alone (CPU, no GPU): per (model, compile mode, phase) and per site.

    python benchmarks/diagnostics/forecast_check.py benchmarks/results/e2e-*-zoo-*.json
    python benchmarks/diagnostics/forecast_check.py FILE... --sites          # every site too
    python benchmarks/diagnostics/forecast_check.py FILE... --exclude 'e2e-*-zoo-8b.json:titan_*'

Measured, per cell (the rows of one file with the same model, shape, compile mode and ckpt):
``comm`` = torch.compile ("default" variant) - nocomm, ``hidden`` = torch.compile - overlap (rows
timed side by side, e2e.py --interleave: from the rounds' own ratios, e2e_report.speedup),
``share`` = hidden / comm (e2e.py's "gap closed"). Forecast, from the overlap row's sites: the
sites' collectives at the profile's curves (``comm_ms``), what the rewritten sites are predicted
to save (``hidden_ms``), the credit for compute moved beside collectives left as written
(``deferred_ms``, not counted), the nocomm bound's stand-in copies (``standin_ms``), and the
shares: of the collectives (``hidden_share``), of the gap to the bound (``gap_share``, the one to
hold against the measured share), and with the deferred credit counted (``with_deferred_share``).

Each term the forecast adds up is shown beside what measures it:
- denominator: predicted comm against torch.compile - nocomm, and the stand-in copies the bound
  pays (the bound is not the step without communication);
- numerator per graph: the forward's predicted gain against the prefill's measured one (the same
  sites, no backward), the backward's against train - prefill (an estimate: the train step's
  forward gains what prefill gains); the deferred credit apart;
- per site: template, predicted gain, the collective's price, the gain settle measured for the
  site alone (passes/settle.py, where it did), and what the split GEMM costs beyond the whole one
  as the models price it (``split_ms``: W x slices pieces for p2p_ring at predictor.models.slice_ms,
  which diagnostics/split_gemm.py measured; ``chunks`` pieces for priority_stream at the GEMM
  table's rows, as its model prices them);
- the graph's first site (``first``): where a collective waits for the slowest rank to arrive.
- collectives the bound replaced (``nocomm_replaced``) that are no site: communication the
  forecast does not see (in graphs, or eager outside them: "all_reduce (eager)");
- a bound whose stand-ins were slower than the forecast prices (``nocomm_standins``, rows from
  before nocomm.STANDINS 2: each all-gather's a strided copy).

``check(rows)`` returns the cells as dicts (tests use it); ``errors(cells)`` the bias and mean
absolute error of each forecast share against the measured one, per phase, the measured share
clipped to [0, 1] (above 1 the bound is no bound).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

PHASES = ("train", "prefill")
SHARES = ("hidden_share", "gap_share", "with_deferred_share")


def _key(r: dict) -> tuple:
    return (r.get("model"), json.dumps(r.get("shape"), sort_keys=True, default=str), r.get("compile_mode"),
            r.get("ckpt"), r.get("seq"), r.get("dynamic"))


def _median_ms(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def _side_by_side(default: list[dict], over: list[dict], nocomm: list[dict], k: str) -> tuple | None:
    """(hidden ms, comm ms) in units of torch.compile's median, from e2e_report.speedup's ratios
    taken round by round, where the three rows were timed side by side (``interleaved``); else None."""
    from benchmarks.e2e_report import speedup

    if len(default) != 1 or len(over) != 1 or len(nocomm) != 1 or not over[0].get("interleaved"):
        return None
    d, o, b = default[0], over[0], nocomm[0]
    if k not in o or k not in b or not (d.get("interleaved") == o["interleaved"] == b.get("interleaved")):
        return None
    return d[k] * (1 - 1 / speedup(d, o, k)), d[k] * (1 - 1 / speedup(d, b, k))


def _profile(device: str | None):
    from overlap_compile.predictor import load_profile
    from overlap_compile.predictor.profile import builtin_for_device

    name = builtin_for_device(device or "")
    return load_profile(name) if name else None


def _chosen_config(site: dict) -> dict:
    """The chosen candidate's config, read off its label in predicted_ms ("p2p_ring[slices=1,...]")."""
    chosen = site.get("chosen_ms")
    for label, ms in (site.get("predicted_ms") or {}).items():
        if label.startswith(site.get("template", "") + "[") and ms is not None and chosen is not None \
                and abs(ms - chosen) < 1e-9:
            return dict(re.findall(r"(\w+)=([^,\]]+)", label))
    return {}


def split_ms(site: dict, world: int, dtype: str, profile) -> float:
    """What the rewritten site's row pieces cost beyond its whole GEMM(s), as its template's model
    prices a piece."""
    from overlap_compile.predictor.models import Site, slice_ms

    if profile is None or not site.get("rewritten") or not site.get("gemms"):
        return 0.0
    cfg = _chosen_config(site)
    if site.get("template") == "p2p_ring":
        pieces = world * int(cfg.get("slices", 1) or 1)
    elif site.get("template") == "priority_stream":
        pieces = int(cfg.get("chunks", 1) or 1)
    else:
        return 0.0  # tile-level templates run one kernel over the whole GEMM
    if pieces <= 1:
        return 0.0
    gemms = tuple(tuple(g) for g in site["gemms"])
    whole = sum(profile.gemm.ms(m, n, k, dtype) for m, n, k in gemms)
    if site.get("template") == "priority_stream":  # its model prices a chunk at the table's rows
        return sum(pieces * profile.gemm.ms(max(1, m // pieces), n, k, dtype) for m, n, k in gemms) - whole
    return pieces * slice_ms(Site(site.get("kind", "allgather_gemm"), gemms, world, dtype), profile,
                             max(1, gemms[0][0] // pieces)) - whole


def _site_rows(sites: list[dict], world: int, dtype: str, profile) -> list[dict]:
    from overlap_compile.report import forecast

    out, seen = [], set()
    for s in sites:
        one = forecast([s], profile, world, dtype)["all"]
        measured = s.get("measured") or {}
        gain = None
        if measured.get("baseline_ms") and measured.get("ms") and measured.get("template") == s.get("template"):
            gain = measured["baseline_ms"] - measured["ms"]
        out.append({"graph": s.get("graph"), "kind": s.get("kind"), "template": s.get("template"),
                    "gemms": s.get("gemms"), "comm_ms": s.get("comm_ms") or 0.0, "gain_ms": one["hidden_ms"],
                    "deferred_ms": one["deferred_ms"], "standin_ms": one["standin_ms"], "measured_gain_ms": gain,
                    "split_ms": split_ms(s, world, dtype, profile), "first": s.get("graph") not in seen})
        seen.add(s.get("graph"))
    return out


def check(rows: list[dict], source: str = "", profile=None) -> list[dict]:
    """One dict per (model, shape, compile mode, ckpt, phase) with an overlap row that kept its
    sites: measured and forecast numbers (see the module docstring). ``profile``: a
    HardwareProfile; by default the built-in one of the rows' device."""
    from overlap_compile.report import forecast

    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        if r.get("benchmark", "e2e") == "e2e" and "variant" in r and ("train_ms" in r or "prefill_ms" in r):
            groups.setdefault(_key(r), {}).setdefault(r["variant"], []).append(r)
    cells = []
    for key, variants in groups.items():
        over = [r for r in variants.get("overlap", []) if r.get("sites")]
        if not over or "default" not in variants:
            continue
        ov = over[0]
        prof = profile if profile is not None else _profile(ov.get("device"))
        world, dtype = int(ov.get("world_size") or 2), str(ov.get("dtype") or "bfloat16")
        nocomm = variants.get("nocomm", [])
        replaced = dict(nocomm[0].get("nocomm_replaced") or {}) if nocomm else {}
        in_graphs = sum(v for k, v in replaced.items() if "eager" not in k)
        for phase in PHASES:
            sites = [s for s in ov["sites"] if s.get("phase") == phase]
            k = f"{phase}_ms"
            ind, ovl = _median_ms(variants["default"], k), _median_ms(over, k)
            if not sites or ind is None or ovl is None:
                continue
            bound = _median_ms(nocomm, k)
            fc = forecast(sites, prof, world, dtype)
            meas_comm = ind - bound if bound is not None else None
            meas_hidden = ind - ovl
            side = _side_by_side(variants["default"], over, nocomm, k)
            if side is not None:  # timed side by side (e2e --interleave): from the rounds' own ratios
                meas_hidden, meas_comm = side
            per_graph = {}
            for name, g in fc.items():
                if name == "all":
                    continue
                part = "backward" if str(name).startswith("backward") else "forward"
                p = per_graph.setdefault(part, {"hidden_ms": 0.0, "deferred_ms": 0.0, "comm_ms": 0.0})
                for q in p:
                    p[q] += g[q]
            cells.append({
                "source": source, "model": ov.get("model"), "mode": ov.get("compile_mode"), "phase": phase,
                "device": ov.get("device"), "profile": getattr(prof, "name", None),
                "inductor_ms": ind, "overlap_ms": ovl, "nocomm_ms": bound,
                "measured_comm_ms": meas_comm, "measured_hidden_ms": meas_hidden,
                "measured_share": meas_hidden / meas_comm if meas_comm and meas_comm > 0 else None,
                "forecast": fc["all"], "graphs": per_graph,
                "sites": _site_rows(sites, world, dtype, prof),
                "collectives_not_sites": max(0, in_graphs - len(ov["sites"])) if replaced else None,
                "eager_outside_graphs": sum(v for k2, v in replaced.items() if "eager" in k2),
                "bound_standins": nocomm[0].get("nocomm_standins", 1) if nocomm else None,
            })
    # the backward's measured gain, estimated as train - prefill of the same configuration
    by = {(c["source"], c["model"], c["mode"], c["phase"]): c for c in cells}
    for c in cells:
        pre = by.get((c["source"], c["model"], c["mode"], "prefill"))
        if c["phase"] == "train" and pre is not None:
            c["measured_backward_ms"] = c["measured_hidden_ms"] - pre["measured_hidden_ms"]
    return cells


def check_files(paths: list[str], exclude: list[str] = ()) -> list[dict]:
    cells = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        base = os.path.basename(path)
        cells += [c for c in check(rows, base)
                  if not any(fnmatch.fnmatch(f"{base}:{c['model']}", pat) for pat in exclude)]
    return cells


def errors(cells: list[dict]) -> dict:
    """phase -> share name -> (bias, mean absolute error, cells) of the forecast share against the
    measured one clipped to [0, 1]."""
    out: dict = {}
    for phase in PHASES:
        pairs = [(c["forecast"], min(1.0, max(0.0, c["measured_share"]))) for c in cells
                 if c["phase"] == phase and c["measured_share"] is not None]
        for name in SHARES:
            diffs = [f[name] - m for f, m in pairs if f.get(name) is not None]
            if diffs:
                out.setdefault(phase, {})[name] = (statistics.mean(diffs), statistics.mean(map(abs, diffs)), len(diffs))
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(cells: list[dict], sites: bool = False) -> str:
    head = ("| source | model | mode | phase | measured share | forecast gap share | hidden share | with deferred | "
            "comm pred / meas / stand-ins | hidden pred / meas | fwd pred | bwd pred (+deferred) / meas (train-prefill) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        fc, g = c["forecast"], c["graphs"]
        fwd, bwd = g.get("forward", {}), g.get("backward", {})
        bwd_txt = "-" if not bwd else f"{bwd['hidden_ms']:.2f} (+{bwd['deferred_ms']:.2f}) / {_ms(c.get('measured_backward_ms'))}"
        lines.append(
            f"| {c['source']} | {c['model']} | {c['mode']} | {c['phase']} | {_pct(c['measured_share'])} | "
            f"{_pct(fc['gap_share'])} | {_pct(fc['hidden_share'])} | {_pct(fc['with_deferred_share'])} | "
            f"{fc['comm_ms']:.2f} / {_ms(c['measured_comm_ms'])} / {fc['standin_ms']:.2f} | "
            f"{fc['hidden_ms']:.2f} / {c['measured_hidden_ms']:.2f} | {_ms(fwd.get('hidden_ms'))} | {bwd_txt} |")
        if sites:
            for s in c["sites"]:
                gemm = ",".join("x".join(map(str, x)) for x in s["gemms"] or [])
                lines.append(
                    f"|  | {s['graph']}{' (first)' if s['first'] else ''} | {s['kind']} | {s['template']} | "
                    f"gain {s['gain_ms']:.3f} | deferred {s['deferred_ms']:.3f} | comm {s['comm_ms']:.3f} | "
                    f"alone {_ms(s['measured_gain_ms'])} | "
                    f"split {s['split_ms']:+.3f} | {gemm} | |")
        notes = []
        if c.get("collectives_not_sites"):
            notes.append(f"{c['collectives_not_sites']} collectives in the graphs are no site")
        if c.get("eager_outside_graphs"):
            notes.append(f"eager all-reduce outside the graphs, {c['eager_outside_graphs']} calls over the run "
                         "(the bound removes them, the forecast does not see them)")
        if c.get("bound_standins") == 1:
            notes.append("a bound from before its all-gather stand-in was one cat (nocomm.STANDINS): each ran "
                         "as a strided copy at about a third of the copy bandwidth the forecast prices, so the "
                         "measured gap is short by the difference")
        if notes and c["phase"] == "train":
            lines.append(f"|  | {'; '.join(notes)} |||||||||||")
    return "\n".join(lines)


def summary(cells: list[dict]) -> str:
    lines = []
    for phase, per in errors(cells).items():
        for name, (bias, mae, n) in per.items():
            lines.append(f"{phase:8s} {name:20s} bias {bias:+.0%}  mean |error| {mae:.0%}  ({n} cells)")
    meas = [c for c in cells if c["measured_comm_ms"] is not None]
    if meas:
        ratio = [c["measured_comm_ms"] / c["forecast"]["comm_ms"] for c in meas if c["forecast"]["comm_ms"]]
        below = sum(c["measured_comm_ms"] < c["forecast"]["comm_ms"] for c in meas)
        lines.append(f"measured comm (torch.compile - nocomm) / predicted comm: median {statistics.median(ratio):.2f} "
                     f"(range {min(ratio):.2f}-{max(ratio):.2f}); below the prediction in {below} of {len(meas)} cells")
    for phase in PHASES:
        rs = [c["measured_hidden_ms"] / c["forecast"]["hidden_ms"] for c in cells
              if c["phase"] == phase and c["forecast"]["hidden_ms"] > 0]
        if rs:
            lines.append(f"{phase}: measured hidden / predicted hidden: median {statistics.median(rs):.2f} "
                         f"(range {min(rs):.2f}-{max(rs):.2f})")
    bwd = [(c["graphs"]["backward"], c["measured_backward_ms"]) for c in cells
           if "measured_backward_ms" in c and "backward" in c["graphs"]]
    if bwd:
        lines.append(f"backward, summed over {len(bwd)} cells: predicted {sum(g['hidden_ms'] for g, _ in bwd):.2f} ms "
                     f"(+{sum(g['deferred_ms'] for g, _ in bwd):.2f} deferred credit), measured (train - prefill) "
                     f"{sum(m for _, m in bwd):.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="e2e result JSON files")
    ap.add_argument("--sites", action="store_true", help="a row per site under each cell")
    ap.add_argument("--exclude", action="append", default=[],
                    help="'<file name>:<model>' pattern (fnmatch) of cells to leave out; repeatable")
    ap.add_argument("--json", help="write the cells here")
    a = ap.parse_args(argv)
    cells = check_files(a.files, a.exclude)
    print(table(cells, a.sites))
    print()
    print(summary(cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(cells, f, indent=1, default=str)


if __name__ == "__main__":
    main()
