"""One plotter for every results file of the common schema (DESIGN.md, "Benchmark results").

    python benchmarks/plot.py benchmarks/results/ops-NVIDIA_H200-w4-*.json [--out DIR] [--markdown]

Per (kind, mode): speedup over the method "sequential" (or "cublas", or "inductor") of the same
shape, one bar per method, with the overlap bound's speedup drawn as a tick where rows carry
``bound_ms``. ``--markdown`` also prints a table of the same numbers, with the share of the
communication hidden where the baseline row carries ``comm_ms`` (CommFuse's metric:
(sequential - overlapped) / communication time). ``--metric KEY`` plots
another time column of the rows (e.g. e2e's ``prefill_ms``); rows without it (errors, skipped
configurations, checks) are left out. Rows that carry ``routing`` (benchmarks/moe.py) are compared
per routing: their kind reads ``<kind>-<routing>``. Rows that carry ``experts`` (benchmarks/moe.py)
also get latency against the expert count (FlashDMoE's Fig. 6.5: a flat line is the goal): one
figure per kind and group of shapes that differ only in it, one panel per (routing, mode), one line
per method (the nocomm bound dashed).

End-to-end rows (benchmarks/e2e.py) also get one bar chart per (model, compile mode, phase): the
step time of inductor, async_tp, overlap and nocomm (the comm-free bound) per shape, each bar
between the two labelled with the share of the gap to the bound it closes,
(inductor - method) / (inductor - nocomm); ``--markdown`` prints the same as a table.

Three benchmarks' own charts are drawn here too, called by them as they write their rows:
``plot_occupancy`` (diagnostics/occupancy_sweep.py: speedup against the GEMM's programs),
``plot_error_cdf`` (predictor.py: the CDF of the prediction error) and ``plot_exposed_comm``
(diagnostics/exposed_comm.py: a step's compute, hidden and exposed communication per variant).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict

BASELINES = ("sequential", "cublas", "inductor", "bmm")
E2E_METHODS = ("inductor", "async_tp", "overlap", "nocomm", "nocomm_nopad")  # bar order: baseline ... bounds
# methods that change what the step computes (e2e.py's bounds): labelled "(bound)", never a gap closer
E2E_BOUNDS = ("nocomm", "nocomm_nopad")
E2E_PHASES = {"train": "train_ms", "prefill": "prefill_ms"}


def kind_of(r: dict) -> str | None:
    """The row's kind, with its routing where it has one (moe.py: "moe_forward-skewed")."""
    kind = r.get("kind")
    return f"{kind}-{r['routing']}" if kind is not None and r.get("routing") else kind


def speedups(rows: list[dict], metric: str = "ms") -> dict:
    """(kind, mode) -> shape label -> method -> (speedup, bound speedup or None)."""
    rows = [r for r in rows if "method" in r and isinstance(r.get(metric), (int, float)) and r[metric] == r[metric]]
    base = {}
    for r in rows:
        if r["method"] in BASELINES:
            base[(kind_of(r), json.dumps(r["shape"]), r["mode"])] = r[metric]
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        key = (kind_of(r), json.dumps(r["shape"]), r["mode"])
        if r["method"] in BASELINES or key not in base:
            continue
        bound = base[key] / r["bound_ms"] if r.get("bound_ms") and metric == "ms" else None
        label = "x".join(map(str, r["shape"])) if isinstance(r["shape"], list) else str(r["shape"])
        out[(key[0], r["mode"])][label][r["method"]] = (base[key] / r[metric], bound)
    return out


def hidden(rows: list[dict]) -> dict:
    """(kind, mode) -> shape label -> method -> share of the communication hidden,
    (baseline ms - ms) / the baseline row's comm_ms (1.0: all of it; negative: slower)."""
    comm = {}
    for r in rows:
        if r.get("method") in BASELINES and r.get("comm_ms"):
            comm[(kind_of(r), json.dumps(r["shape"]), r["mode"])] = (r["ms"], r["comm_ms"])
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        key = (kind_of(r), json.dumps(r.get("shape")), r.get("mode"))
        ms = r.get("ms")
        if r.get("method") in BASELINES or key not in comm or not isinstance(ms, (int, float)) or ms != ms:
            continue
        base_ms, comm_ms = comm[key]
        label = "x".join(map(str, r["shape"])) if isinstance(r["shape"], list) else str(r["shape"])
        out[(key[0], r["mode"])][label][r["method"]] = (base_ms - ms) / comm_ms
    return out


def gap_closed(base_ms: float, ms: float, bound_ms: float) -> float | None:
    """Share of the distance from the baseline to the bound that ``ms`` covers (1: at the bound, 0:
    no better than the baseline, < 0: slower); None when the bound is no faster than the baseline."""
    gap = base_ms - bound_ms
    return (base_ms - ms) / gap if gap > 0 else None


def _e2e_label(r: dict) -> str:
    force = (r.get("config") or {}).get("force_template")
    return r["method"] + (f"[{force}]" if force else "")


def e2e_bars(rows: list[dict]) -> dict:
    """(model, compile mode, phase) -> shape -> method label -> ms, for e2e rows that measured the phase."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("benchmark") != "e2e" or "method" not in r:
            continue
        for phase, key in E2E_PHASES.items():
            ms = r.get(key)
            if isinstance(ms, (int, float)) and ms == ms:
                out[(r["kind"], r.get("compile_mode", r.get("mode")), phase)][str(r["shape"])][_e2e_label(r)] = ms
    return out


def e2e_gaps(bars: dict, rows: list[dict] | None = None, cell: tuple | None = None) -> dict:
    """shape -> method label -> gap closed, for one (model, compile mode, phase) ``cell`` of
    ``e2e_bars``; only shapes with both an inductor and a nocomm time. From the medians, except
    where a row of ``rows`` carries its own (``<phase>_gap_closed``, e2e_report.compare's: from the
    rounds' ratios for variants timed side by side), so a plot says what the table says."""
    own = {}
    if rows is not None and cell is not None:
        model, compile_mode, phase = cell
        for r in rows:
            g = r.get(f"{phase}_gap_closed")
            if r.get("kind") == model and r.get("compile_mode", r.get("mode")) == compile_mode and g is not None:
                own[(str(r["shape"]), _e2e_label(r))] = g
    out: dict = {}
    for shape, ms in bars.items():
        if "inductor" in ms and "nocomm" in ms:
            out[shape] = {m: own.get((shape, m), gap_closed(ms["inductor"], t, ms["nocomm"])) for m, t in ms.items()
                          if m != "inductor" and m not in E2E_BOUNDS}
    return out


def _e2e_order(methods) -> list[str]:
    rank = {m: i for i, m in enumerate(E2E_METHODS)}
    return sorted(methods, key=lambda m: (rank.get(m.split("[")[0], len(rank)), m))


def _e2e_colour(method: str) -> str:
    """One colour per method in every e2e plot, whichever methods a plot lacks (a failed row)."""
    rank = {m: i for i, m in enumerate(E2E_METHODS)}
    return f"C{rank.get(method.split('[')[0], len(rank)) % 10}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: str) -> str:
    ax.legend(fontsize=8)
    return _write(plt, fig, path)


def _write(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict], out_dir: str, stem: str, metric: str = "ms") -> list[str]:
    plt = _pyplot()
    paths = []
    for (kind, mode), shapes in sorted(speedups(rows, metric).items()):
        methods = sorted({m for d in shapes.values() for m in d})
        labels = list(shapes)
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            xs = [j + i * width for j in range(len(labels))]
            ys = [shapes[l].get(m, (math.nan, None))[0] for l in labels]
            ax.bar(xs, ys, width, label=m)
            for x, l in zip(xs, labels):
                b = shapes[l].get(m, (None, None))[1]
                if b:
                    ax.plot([x - width / 2, x + width / 2], [b, b], color="k", lw=1)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over baseline" + (f", {metric}" if metric != "ms" else "") + " (tick: bound)")
        ax.set_title(f"{kind} ({mode}) — {rows[0].get('device', '')} x{rows[0].get('world_size', '')}")
        paths.append(_save(plt, fig, ax, os.path.join(out_dir, f"{stem}-{kind}-{mode}.png")))
    return paths


def plot_e2e(rows: list[dict], out_dir: str, stem: str) -> list[str]:
    plt = _pyplot()
    paths = []
    for (model, compile_mode, phase), shapes in sorted(e2e_bars(rows).items()):
        methods = _e2e_order({m for d in shapes.values() for m in d})
        labels, gaps = list(shapes), e2e_gaps(shapes, rows, (model, compile_mode, phase))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels) * len(methods) / 4), 4))
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            xs = [j + i * width for j in range(len(labels))]
            ys = [shapes[l].get(m, math.nan) for l in labels]
            ax.bar(xs, ys, width, color=_e2e_colour(m), label=m + (" (bound)" if m in E2E_BOUNDS else ""))
            for x, y, l in zip(xs, ys, labels):
                g = gaps.get(l, {}).get(m)
                if g is not None and y == y:
                    ax.annotate(f"{g:.0%}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=15, ha="right", fontsize=8)
        ax.set_ylabel(f"{phase} ms (label: share of the gap inductor -> nocomm closed)", fontsize=8)
        ax.set_title(f"{model}, {compile_mode}, {phase} — {rows[0].get('device', '')} x{rows[0].get('world_size', '')}",
                     fontsize=9)
        paths.append(_save(plt, fig, ax, os.path.join(out_dir, f"{stem}-e2e-{model}-{compile_mode}-{phase}.png")))
    return paths


def e2e_summary(rows: list[dict]) -> dict:
    """model -> [(cell label "mode, phase", {method: ms / inductor's ms}, {method: gap closed})], the
    cells with an inductor time (first shape of each model), in compile mode then phase order."""
    out: dict = defaultdict(list)
    for (model, compile_mode, phase), shapes in sorted(e2e_bars(rows).items()):
        shape, ms = next(iter(shapes.items()))
        if "inductor" not in ms:
            continue
        gaps = e2e_gaps({shape: ms}, rows, (model, compile_mode, phase)).get(shape, {})
        out[model].append((f"{compile_mode}, {phase}", {m: t / ms["inductor"] for m, t in ms.items()}, gaps))
    return dict(out)


def plot_e2e_summary(rows: list[dict], out_dir: str, stem: str) -> list[str]:
    """One figure for the whole run: per model a panel, per (compile mode, phase) a group of bars,
    each method's step time relative to inductor's (the bound: nocomm), labelled with the share
    of the gap inductor -> nocomm it closes. Relative and zoomed, so a 5% gap is visible."""
    summary = e2e_summary(rows)
    if not summary:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.2), squeeze=False)
    for ax, (model, cells) in zip(axes[0], sorted(summary.items())):
        methods = _e2e_order({m for _, rel, _ in cells for m in rel})
        width = 0.8 / max(len(methods), 1)
        low = min(v for _, rel, _ in cells for v in rel.values())
        high = max(1.0, max(v for _, rel, _ in cells for v in rel.values()))
        for i, m in enumerate(methods):
            xs = [j + i * width for j in range(len(cells))]
            ys = [rel.get(m, math.nan) for _, rel, _ in cells]
            ax.bar(xs, ys, width, color=_e2e_colour(m), label=m + (" (bound)" if m in E2E_BOUNDS else ""))
            for x, y, (_, _, gaps) in zip(xs, ys, cells):
                g = gaps.get(m)
                if g is not None and y == y:
                    ax.annotate(f"{g:.0%}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_ylim(low - 0.25 * (high - low) - 0.005, high + 0.15 * (high - low) + 0.005)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], [c.replace(", ", "\n") for c, _, _ in cells],
                      fontsize=8)
        ax.set_ylabel("step time / inductor's (label: share of the gap to the bound closed)", fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{rows[0].get('device', '')} x{rows[0].get('world_size', '')}, torch {rows[0].get('torch', '')}, "
                 f"{rows[0].get('date', '')}", fontsize=9)
    return [_write(plt, fig, os.path.join(out_dir, f"{stem}-e2e-summary.png"))]


def markdown_e2e(rows: list[dict]) -> str:
    lines = []
    for (model, compile_mode, phase), shapes in sorted(e2e_bars(rows).items()):
        methods = _e2e_order({m for d in shapes.values() for m in d})
        closing = [m for m in methods if m != "inductor" and m not in E2E_BOUNDS]
        gaps = e2e_gaps(shapes, rows, (model, compile_mode, phase))
        lines += [f"\n**{model}, {compile_mode}, {phase}** (ms; gap closed = (inductor - method) / "
                  "(inductor - nocomm))\n",
                  "| shape | " + " | ".join(methods) + " | " + " | ".join(f"gap closed {m}" for m in closing) + " |",
                  "|---" * (len(methods) + len(closing) + 1) + "|"]
        for label, ms in shapes.items():
            times = [f"{ms[m]:.3f}" if m in ms else "-" for m in methods]
            closed = [f"{g:.0%}" if (g := gaps.get(label, {}).get(m)) is not None else "-" for m in closing]
            lines.append(f"| {label} | " + " | ".join(times + closed) + " |")
    return "\n".join(lines)


def by_experts(rows: list[dict], metric: str = "ms") -> dict:
    """(kind, sizes) -> (routing, mode) -> method -> sorted [(experts, time)] for rows carrying
    ``experts`` (routing None where rows have none); only groups with two or more expert counts."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if "experts" in r and "method" in r and isinstance(r.get(metric), (int, float)) and r[metric] == r[metric]:
            sizes = json.dumps({**r.get("sizes", {}), "topk": r.get("topk")}, sort_keys=True)
            out[(r["kind"], sizes)][(r.get("routing"), r["mode"])][r["method"]].append((r["experts"], r[metric]))
    return {k: {p: {m: sorted(v) for m, v in d.items()} for p, d in panels.items()} for k, panels in out.items()
            if len({e for d in panels.values() for pts in d.values() for e, _ in pts}) >= 2}


def _first(known: tuple):
    """Sort key: the values of ``known`` in that order, then the others (None first)."""
    return lambda v: (v is not None, known.index(v) if v in known else len(known), str(v))


def plot_by_experts(rows: list[dict], out_dir: str, stem: str, metric: str = "ms") -> list[str]:
    plt = _pyplot()
    paths = []
    for i, ((kind, sizes), panels) in enumerate(sorted(by_experts(rows, metric).items())):
        routings = sorted({r for r, _ in panels}, key=_first(("uniform", "skewed")))
        modes = sorted({m for _, m in panels}, key=_first(("eager", "cuda_graph")))
        fig, axes = plt.subplots(len(routings), len(modes), figsize=(5 * len(modes), 3.6 * len(routings)),
                                 squeeze=False, sharex=True)
        for (routing, mode), methods in panels.items():
            ax = axes[routings.index(routing)][modes.index(mode)]
            for m, pts in sorted(methods.items()):
                ax.plot([e for e, _ in pts], [t for _, t in pts], marker="o", label=m + (" (bound)" if m in E2E_BOUNDS else ""),
                        ls="--" if m == "nocomm" else "-")
            experts = sorted({e for pts in methods.values() for e, _ in pts})
            ax.set_xscale("log", base=2)
            ax.set_xticks(experts, [str(e) for e in experts])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("experts")
            ax.set_ylabel(metric)
            ax.set_title(f"{routing or 'routing -'}, {mode}", fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle(f"{kind} {sizes} — {rows[0].get('device', '')} x{rows[0].get('world_size', '')}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}-{kind}-by-experts-{i}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_occupancy(rows: list[dict], path: str) -> None:
    """diagnostics/occupancy_sweep.py's rows: speedup over sequential against the persistent GEMM's
    programs, one line per (tile, stages, priority), cuBLAS chunks as horizontal lines."""
    plt = _pyplot()
    seq = next(r["ms"] for r in rows if r["method"] == "sequential")
    fig, ax = plt.subplots(figsize=(7, 4))
    lines: dict = {}
    for r in rows:
        c = r.get("config") or {}
        if r["method"] != "priority_stream" or c.get("block_m") is None:
            continue
        key = (f"{c['block_m']}x{c['block_n']} {c['stages']} stages", c["priority"])
        lines.setdefault(key, []).append((c["programs"], seq / r["ms"]))
    for (tile, prio), pts in sorted(lines.items(), key=str):
        pts.sort()
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", ls="-" if prio == "highest" else "--",
                label=f"{tile}, priority {prio}")
    for r in rows:
        c = r.get("config") or {}
        if r["method"] == "priority_stream" and c.get("block_m") is None:
            ax.axhline(seq / r["ms"], color="k" if c["priority"] == "highest" else "gray", lw=1,
                       ls="-" if c["priority"] == "highest" else "--", label=f"cuBLAS chunks, priority {c['priority']}")
    ax.axhline(1.0, color="r", lw=0.8, ls=":")
    ax.set_xlabel("persistent GEMM programs (SMs held)")
    ax.set_ylabel("speedup over sequential (CUDA graph)")
    ax.set_title(f"{rows[0]['kind']} {rows[0]['shape']} - {rows[0]['device']} x{rows[0]['world_size']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_error_cdf(rows: list[dict], path: str, title: str) -> str:
    """predictor.py's rows: the CDF of |predicted / measured - 1| per launch mode ("auto" rows
    left out), a dashed line at 5%. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for mode in ("eager", "cuda_graph"):
        e = sorted(abs(r["error"]) * 100 for r in rows
                   if r.get("error") is not None and r["mode"] == mode and r["method"] != "auto")
        if e:
            ax.step(e, [(i + 1) / len(e) for i in range(len(e))], where="post", label=f"{mode} (n={len(e)})")
    ax.axvline(5, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("|predicted / measured - 1| (%)")
    ax.set_ylabel("fraction of configurations")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_exposed_comm(rows: list[dict], path: str) -> str:
    """diagnostics/exposed_comm.py's rows of one model and compile mode: per variant a stacked
    bar of the step's compute, hidden communication and exposed communication split per site
    (the most exposed sites by name, the others as one segment), ms per step. Raises ImportError
    without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r for r in rows if r.get("site") == "(step)" and "exposed_ms" in r]
    sites = [r for r in rows if r.get("site") != "(step)" and r.get("exposed_ms")]
    worst = sorted({r["site"] for r in sites}, key=lambda s: -max(r["exposed_ms"] for r in sites if r["site"] == s))[:8]
    fig = Figure(figsize=(max(5, 1.6 * len(steps) + 3), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colors = {s: f"C{i + 2}" for i, s in enumerate(worst)}
    labelled: set = set()
    for x, r in enumerate(steps):
        parts = [("compute", r["compute_ms"], "0.75"), ("hidden comm", r["hidden_ms"], "C0")]
        mine = [s for s in sites if s["variant"] == r["variant"]]
        parts += [(s["site"], s["exposed_ms"], colors[s["site"]]) for s in mine if s["site"] in colors]
        parts.append(("other exposed", sum(s["exposed_ms"] for s in mine if s["site"] not in colors), "C1"))
        bottom = 0.0
        for name, ms, color in parts:
            ax.bar(x, ms, 0.6, bottom=bottom, color=color, label=None if name in labelled else name)
            labelled.add(name)
            bottom += ms
    ax.set_xticks(range(len(steps)), [r["variant"] for r in steps])
    ax.set_ylabel("ms per step (exposed: per site, not under compute)")
    first = (steps or rows)[0]
    ax.set_title(f"{first.get('model')}, {first.get('compile_mode')} - {first.get('device', '')} "
                 f"x{first.get('world_size', '')}", fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def markdown(rows: list[dict], metric: str = "ms") -> str:
    lines = []
    hid = hidden(rows) if metric == "ms" else {}
    for (kind, mode), shapes in sorted(speedups(rows, metric).items()):
        methods = sorted({m for d in shapes.values() for m in d})
        lines += [f"\n**{kind}, {mode}** (speedup over sequential; bound in parentheses; share of the "
                  f"communication hidden)\n",
                  "| shape | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        for label, d in shapes.items():
            cells = []
            for m in methods:
                s, b = d.get(m, (None, None))
                h = hid.get((kind, mode), {}).get(label, {}).get(m)
                cells.append("-" if s is None else f"{s:.2f}x" + (f" ({b:.2f}x)" if b else "")
                             + (f", {h:.0%} hidden" if h is not None else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for m in methods:
            vals = [d[m][0] for d in shapes.values() if m in d and d[m][0] > 0]
            if vals:
                lines.append(f"| geomean {m} | {math.exp(sum(map(math.log, vals)) / len(vals)):.2f}x | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--metric", default="ms", help="the rows' time column to compare (default ms)")
    args = ap.parse_args()
    for path in args.files:
        rows = json.load(open(path))
        out_dir = args.out or os.path.dirname(path) or "."
        stem = os.path.splitext(os.path.basename(path))[0] + ("" if args.metric == "ms" else f"-{args.metric}")
        for p in plot(rows, out_dir, stem, args.metric) + plot_by_experts(rows, out_dir, stem, args.metric) \
                + plot_e2e(rows, out_dir, stem) + plot_e2e_summary(rows, out_dir, stem):
            print("wrote", p)
        if args.markdown:
            print(markdown(rows, args.metric))
            print(markdown_e2e(rows))


if __name__ == "__main__":
    main()
