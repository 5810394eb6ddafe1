"""The overlap pass on one graph: find -> decide -> rewrite, then MoE dispatch buffers are filled
without per-element atomics (moe_scatter.py) and the collectives left as written get independent
compute under them (defer_compute.py), run on the high-priority stream (prioritize.py); and the
record of what happened."""
from __future__ import annotations

import dataclasses
import time
import warnings

import torch.fx as fx

from ..config import Options
from ..report import GraphRecord, SiteReport
from .as_written_rows import as_written_limits
from .decide import Decision, decide
from .defer_compute import defer_independent_compute
from .find import find
from .graph_utils import size_reads_after_waits
from .matches import dtype_name
from .moe_scatter import scatter_moe_buffers
from .prioritize import prioritize_deferred
from . import replay_kept
from .rewrite import rewrite


def graph_role(graph: fx.Graph) -> str:
    """AOTAutograd names the backward graph's gradient inputs ``tangents_*``."""
    for n in graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            return "backward"
    return "forward"


def readable(graph: fx.Graph) -> str:
    return graph.python_code(root_module="self").src


def run_on_graph(graph: fx.Graph, options: Options, graph_name: str | None = None) -> GraphRecord:
    start = time.perf_counter()
    name = graph_name or graph_role(graph)
    before = readable(graph)
    try:
        size_reads_after_waits(graph)  # same values, read from the wait: symbolic sites need it sole
        matches = find(graph, name)
    except Exception as e:  # analysis only, nothing touched yet: the graph is kept exactly as it was
        error = (f"overlap_compile: finding sites in the {name} graph failed ({type(e).__name__}: {e}); "
                 "the graph is left unchanged")
        warnings.warn(error)
        return GraphRecord(name=name, before=before, after=before, sites=[], error=error,
                           pass_seconds=time.perf_counter() - start)
    profile = None
    profile_name = None
    if matches:
        from .. import predictor

        profile = predictor.load_profile(options.profile)
        profile_name = getattr(profile, "name", None)
    decisions = decide(matches, options, profile, graph=graph)
    kept = _replayed_kept(graph, decisions, options)
    decisions = [dataclasses.replace(d, reason=d.reason + replay_kept.NOTE) if id(d.match) in kept else d
                 for d in decisions]
    sites = [_site_report(d, name) for d in decisions]  # before rewrite: node names still valid
    as_written_up_to = as_written_limits(decisions, options.signal_timeout_ms)
    rewrite(graph, decisions, options.signal_timeout_ms, replay_written=replay_kept.replays(options), replay_kept=kept)
    buffers = scatter_moe_buffers(graph, matches) if options.fills_moe_buffers else []
    deferrals = defer_independent_compute(graph) if options.moves_compute else []
    prioritized = prioritize_deferred(graph, deferrals) if options.prioritizes_deferred else []
    on_stream = {p.collective for p in prioritized if p.done}
    for s in sites:
        s.prioritized = s.node in on_stream  # only collectives left as written are taken
    after = readable(graph)
    return GraphRecord(name=name, before=before, after=after, sites=sites, profile=profile_name,
                       pass_seconds=time.perf_counter() - start, deferred=[d.describe() for d in deferrals],
                       prioritized=[p.describe() for p in prioritized], moe_buffers=buffers,
                       as_written_up_to=as_written_up_to)


def _site_report(d: Decision, graph_name: str) -> SiteReport:
    m = d.match
    predicted = {}
    for c in getattr(d, "priced", d.candidates):  # a symbolic site: its size hint's bucket
        label = c.template if c.config is None else f"{c.template}{_short(c.config)}"
        if c.predicted_ms is not None or c.template == "baseline":
            predicted[label] = c.predicted_ms
    return SiteReport(
        kind=m.kind, graph=graph_name, node=m.name(), template=d.template, config=d.config,
        predicted_ms=predicted, reason=d.reason, signature=m.signature(), gemms=m.gemms(),
        world_size=m.world_size, dtype=dtype_name(m.dtype) if m.dtype is not None else "?",
        comm_bytes=m.comm_bytes() if not m.unsupported else 0, host_clock=d.host_clock,
        output_fuses=bool(getattr(m, "output_fuses", False)),
        workspace=_workspace(d), measured=d.measured, buckets=getattr(d, "buckets", None), **_predicted_parts(d),
    )


def _predicted_parts(d: Decision) -> dict:
    base = d.candidates[0] if d.candidates and d.candidates[0].template == "baseline" else None
    if base is None:
        return {}
    chosen = next((c for c in d.candidates if c.template == d.template and c.config == d.config), base)
    return {"comm_ms": base.comm_ms, "hidden_ms": base.hidden_ms, "chosen_ms": chosen.predicted_ms,
            "baseline_host_ms": base.host_ms, "chosen_host_ms": chosen.host_ms}


def _workspace(d: Decision) -> dict | None:
    if d.template == "baseline" or d.config is None:
        return None
    from .. import templates

    return templates.get_spec(d.template).workspace_bytes(d.match, d.config)


def _short(config: dict) -> str:
    """Compact label of a configuration: every key, so distinct candidates never collide."""
    def fmt(v):
        return "-".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    return "[" + ",".join(f"{k}={fmt(v)}" for k, v in sorted(config.items())) + "]" if config else ""


def _replayed_kept(graph: fx.Graph, decisions: list[Decision], options: Options) -> dict:
    """id(match) -> priority_stream's one-chunk plan, for each static site kept as written that
    passes/replay_kept.py replays in this graph."""
    if not decisions or not replay_kept.applies(graph, options):
        return {}
    plans = {id(d.match): replay_kept.written_plan(d.match, options.signal_timeout_ms) for d in decisions
             if not d.rewrites and getattr(d.match, "rows", None) is None}
    return {k: p for k, p in plans.items() if p is not None}
