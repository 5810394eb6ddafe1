"""Predicted schedules as a PNG Gantt chart: why a site was or was not rewritten.

    from overlap_compile.predictor.timeline import draw_timeline
    draw_timeline(report.sites[0], "h200", "site0.png")

Two panels share the time axis: the baseline (GEMM, then the collective) and the chosen
candidate (for signal_reorder: each wave group's GEMM waves on the compute lane, each group's
collective on the comm lane). When the site kept the baseline, the second panel shows the best
signal_reorder candidate the predictor rejected (if the kind supports it), so the lost gain is
visible. Dashed line: the overlap bound (max(GEMM, collective) plus what cannot overlap); dotted
lines: measured times, when given. matplotlib is imported lazily and drawn without pyplot (no
global backend change).
"""
from __future__ import annotations

from typing import Any

from .models import Ctx, Schedule, Site, baseline


def _ctx(mode: str | None) -> Ctx:
    from .. import config
    from . import launch_mode

    o = config.current()
    return Ctx(mode=mode or launch_mode(), first_max=o.wave_group_first_max, last_max=o.wave_group_last_max)


def schedules_for_report(site_report: Any, profile: Any, mode: str | None = None,
                         candidate: tuple[str, dict] | None = None) -> list[tuple[str, Schedule]]:
    """[(title, schedule)]: the baseline, then the chosen (or given, or best rejected) candidate."""
    from . import loaded_profile, template_model

    prof = loaded_profile(profile) if not hasattr(profile, "gemm") else profile
    site = Site.from_report(site_report)
    ctx = _ctx(mode)
    out = []
    base = baseline(site, prof, ctx)
    if base is not None:
        out.append(("baseline" + (" (chosen)" if not site_report.rewritten else ""), base))
    if candidate is None and site_report.rewritten and site_report.config is not None:
        candidate = (site_report.template, site_report.config)
        title = f"{site_report.template} (chosen)"
    elif candidate is not None:
        title = candidate[0]
    else:
        title = None
        sr = template_model("signal_reorder")
        if sr is not None and site.kind in ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall"):
            configs = sr.CONFIGS(site, prof, ctx)
            scored = [(sr.MODEL(site, c, prof, ctx), c) for c in configs]
            scored = [(s, c) for s, c in scored if s is not None]
            if scored:
                sched, _ = min(scored, key=lambda sc: sc[0].total_ms)
                out.append(("signal_reorder, best rejected", sched))
    if candidate is not None:
        model = template_model(candidate[0])
        sched = model.MODEL(site, candidate[1], prof, ctx) if model else None
        if sched is not None:
            out.append((title, sched))
    return out


def _fitting_label(label: str, width: float, char_ms: float) -> str:
    """The label, else a short form ("group 3 (4 waves)" -> "3", "waves 7-10" -> "7-10"), else ""."""
    for text in (label, label.split(" (")[0].split(" ")[-1]):
        if (len(text) + 1) * char_ms <= width:
            return text
    return ""


def draw_timeline(site_report: Any, profile: Any, path: str, measured_ms: dict[str, float] | None = None,
                  mode: str | None = None, candidate: tuple[str, dict] | None = None) -> str:
    """Draw the predicted schedules of ``site_report`` (a report.SiteReport) under ``profile`` (a
    HardwareProfile, a built-in name, a JSON path, or the name of a profile this process loaded,
    i.e. ``GraphRecord.profile``) into the PNG ``path``; returns ``path``.

    ``measured_ms``: {panel title prefix or "baseline"/template name: ms} drawn as dotted lines.
    ``mode``: "eager" or "cuda_graph" launch costs (default: what Inductor is set to).
    ``candidate``: (template, config) to draw instead of the chosen one.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = schedules_for_report(site_report, profile, mode, candidate)
    if not panels:
        raise ValueError(f"no model for a {site_report.kind} site: nothing to draw")
    end = max(max([s.total_ms] + [e.end for e in s.events]) for _, s in panels)
    for v in (measured_ms or {}).values():
        end = max(end, v)
    fig = Figure(figsize=(11, 1.9 * len(panels) + 0.9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colors = {"compute": "#4C72B0", "comm": "#DD8452"}
    base_ms = panels[0][1].total_ms
    char_ms = end * 1.05 / 150  # ~150 characters of 7-pt text across the axis
    for ax, (title, sched) in zip(axes, panels):
        for lane_y, lane in ((1, "compute"), (0, "comm")):
            evs = [e for e in sched.events if e.lane == lane]
            for i, e in enumerate(evs):
                width = max(e.end - e.start, 1e-9)
                shade = 0.65 + 0.35 * (i % 2)
                ax.broken_barh([(e.start, width)], (lane_y - 0.35, 0.7), facecolors=colors[lane],
                               alpha=shade, edgecolor="black", linewidth=0.4)
                label = _fitting_label(e.label, width, char_ms)
                if label:
                    ax.text(e.start + width / 2, lane_y, label, ha="center", va="center", fontsize=7,
                            color="white", clip_on=True)
        ax.set_yticks([0, 1], ["comm", "compute"])
        ax.set_ylim(-0.6, 1.6)
        speed = f", {base_ms / sched.total_ms:.2f}x vs baseline" if sched is not panels[0][1] else ""
        ax.set_title(f"{title}: {sched.total_ms:.3f} ms predicted{speed}", fontsize=9, loc="left")
        if sched.bound_ms is not None:
            ax.axvline(sched.bound_ms, color="green", linestyle="--", linewidth=1)
            ax.text(sched.bound_ms, 1.45, f" bound {sched.bound_ms:.3f}", color="green", fontsize=7, va="center")
        for name, ms in (measured_ms or {}).items():
            if title.startswith(name):
                ax.axvline(ms, color="red", linestyle=":", linewidth=1.2)
                ax.text(ms, -0.5, f" measured {ms:.3f}", color="red", fontsize=7, va="center")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, end * 1.05)
    axes[-1].set_xlabel("ms")
    gemm = ", ".join("x".join(map(str, g)) for g in site_report.gemms)
    fig.suptitle(f"{site_report.graph}/{site_report.node}: {site_report.kind} GEMM {gemm} {site_report.dtype} "
                 f"W={site_report.world_size} - chosen: {site_report.template}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def draw_host_clocks(graph: str, sites: list, path: str) -> str:
    """A host-launched graph's sites on the two simulated clocks (passes/host_pacing.py): per
    site, its host work on the host lane and its GPU time on the GPU lane, coloured by what was
    chosen, the GPU work queued ahead of it (lead) written on the bar. Gaps on the host lane are
    the launches of the graph's other kernels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timed = [s for s in sites if s.host_clock]
    if not timed:
        raise ValueError(f"graph {graph!r}: no site has simulated clocks (not a host-launched graph, or no profile)")
    end = max(max(s.host_clock["host_end"], s.host_clock["gpu_end"]) for s in timed)
    fig = Figure(figsize=(11, 2.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    char_ms = end * 1.05 / 150
    for s in timed:
        c = s.host_clock
        color = "#55A868" if s.rewritten else "#8C8C8C"
        for y, lo, hi in ((1, c["host_start"], c["host_end"]), (0, c["gpu_start"], c["gpu_end"])):
            width = max(hi - lo, 1e-9)
            ax.broken_barh([(lo, width)], (y - 0.35, 0.7), facecolors=color, edgecolor="black", linewidth=0.4)
            text = s.template if y == 1 else f"{s.node} (lead {c['lead']:.2f})"
            label = _fitting_label(text, width, char_ms)
            if label:
                ax.text(lo + width / 2, y, label, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    ax.set_yticks([0, 1], ["GPU", "host"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlim(0, end * 1.05)
    ax.set_xlabel("ms (simulated)")
    ax.grid(axis="x", alpha=0.3)
    rewritten = sum(s.rewritten for s in timed)
    ax.set_title(f"{graph}: {rewritten}/{len(timed)} sites rewritten (green); grey = as written", fontsize=9,
                 loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
