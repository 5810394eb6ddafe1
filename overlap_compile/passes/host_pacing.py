"""host_pacing: in a host-launched graph, is a rewritten site's host time hidden or exposed?

``decide`` prices a site from an idle host, so a template op's host time (profile
``op_overhead_ms``) adds to its GPU time. Inside a graph the host usually runs ahead of the GPU by
the work already queued, and then that host time is free. ``pace`` simulates the graph on two
clocks, node by node, and the graph ends at max(host, gpu)::

    other node    host += launch_ms; gpu = max(gpu, host)   (its GPU time taken as 0: errs towards
                                                             exposing host time)
    site          lead = max(0, gpu - host)                 (the GPU work queued ahead of it)
                  gpu  = max(gpu, host) + t + max(0, h - lead);  host += h
                  (t: predicted GPU time; h: host time; with no lead this is decide's t + h)

Kept sites are tried, largest GPU gain first; one switches to a candidate whose GPU time alone
clears min_speedup x (1 + the CUDA-graph model error) and min_saved_us, and with which the simulated graph ends
earlier; of those, the one ending the graph first is taken. Not applied under CUDA graphs, with
``force_template``, ``search="exhaustive"``, or ``host_pacing=False``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx

from .. import predictor
from ..config import Options
from ..predictor import Candidate
from .decision import Decision, required_gain, saves_too_little


@dataclasses.dataclass
class _Site:
    index: int  # into the decisions list
    baseline: Candidate
    by_gpu: list[Candidate]  # the timed candidates, fastest on the GPU alone (host time left out) first


def pace(graph: fx.Graph, decisions: list[Decision], options: Options, profile: Any) -> list[Decision]:
    """``decisions`` with the sites whose op host time hides behind queued GPU work rewritten."""
    if (predictor.launch_mode() != "eager" or not options.host_pacing or options.force_template is not None
            or options.search != "predict" or not decisions):
        return decisions
    sites = {d.match.anchor(): _Site(i, d.candidates[0], _by_gpu_time(d)) for i, d in enumerate(decisions)
             if not d.match.unsupported and d.candidates and d.candidates[0].predicted_ms is not None}
    if not sites:
        return decisions
    launch = profile.launch("eager")
    site_nodes = {n for d in decisions if not d.match.unsupported for n in _nodes_of(d.match)}
    # the graph in order: the launch cost of the kernel nodes between sites (one sum per run of
    # them: the clocks' rule gives the same result), a _Site per site (at its anchor)
    steps: list[float | _Site] = []
    for node in graph.nodes:
        if node in sites:
            steps.append(sites[node])
        elif node not in site_nodes and _is_kernel(node):
            if steps and isinstance(steps[-1], float):
                steps[-1] += launch
            else:
                steps.append(launch)
    chosen = {id(s): (s.baseline if not decisions[s.index].rewrites else _chosen(decisions[s.index]))
              for s in sites.values()}
    # the CUDA-graph error: with the host part simulated, what is left is the GPU schedule's error
    needed = required_gain(options, profile, "cuda_graph")
    out = list(decisions)
    before, _ = _simulate(steps, chosen)
    for s in sorted(sites.values(), key=lambda s: -_gpu_gain_ms(s)):
        d = decisions[s.index]
        if d.rewrites:
            continue
        base_gpu = _gpu_ms(s.baseline)
        # every candidate that clears the bar on the GPU alone; the one that ends the graph first
        # (a slower op with less host time can win where the fastest cannot hide its host time)
        tries = [c for c in s.by_gpu if 0 < _gpu_ms(c) and base_gpu / _gpu_ms(c) >= needed
                 and not saves_too_little(base_gpu, _gpu_ms(c), options)]
        if not tries:
            continue
        results = [(_simulate(steps, {**chosen, id(s): c}), i, c) for i, c in enumerate(tries)]
        (after, leads), _, best = min(results, key=lambda r: (r[0][0], r[1]))
        lead = leads[id(s)]
        if after < before:
            chosen = {**chosen, id(s): best}
            out[s.index] = Decision(
                d.match, best.template, best.config,
                f"host-launched graph: predicted {base_gpu / _gpu_ms(best):.2f}x on the GPU ({_gpu_ms(best):.3f} vs "
                f"{base_gpu:.3f} ms); the op's {best.host_ms:.3f} ms of host time runs while the GPU works "
                f"through the {lead:.3f} ms queued before it (simulated graph {before:.3f} -> {after:.3f} ms)",
                d.candidates)
            before = after
        else:
            out[s.index] = dataclasses.replace(d, reason=(
                f"{d.reason}; in this host-launched graph the {lead:.3f} ms of GPU work queued before it would "
                f"not hide the op's {best.host_ms:.3f} ms of host time (simulated graph {before:.3f} -> "
                f"{after:.3f} ms)"))
    clocks: dict = {}
    _simulate(steps, chosen, clocks)
    for s in sites.values():
        out[s.index] = dataclasses.replace(out[s.index], host_clock=clocks[id(s)])
    return out


def _simulate(steps: list, chosen: dict, clocks: dict | None = None) -> tuple[float, dict]:
    """(end time, {site id: GPU lead when the host reached it}) of the two-clock model above;
    ``clocks`` (if given) receives each site's Decision.host_clock."""
    host = gpu = 0.0
    leads = {}
    for step in steps:
        if isinstance(step, float):
            host += step
            gpu = max(gpu, host)
            continue
        c = chosen[id(step)]
        h = c.host_ms
        lead = max(0.0, gpu - host)
        leads[id(step)] = lead
        start = max(gpu, host)
        gpu = start + _gpu_ms(c) + max(0.0, h - lead)
        if clocks is not None:
            clocks[id(step)] = {"host_start": round(host, 6), "host_end": round(host + h, 6),
                                "gpu_start": round(start, 6), "gpu_end": round(gpu, 6), "lead": round(lead, 6)}
        host += h
    return max(host, gpu), leads


def _gpu_ms(c: Candidate) -> float:
    return c.predicted_ms - c.host_ms


def _gpu_gain_ms(s: _Site) -> float:
    return _gpu_ms(s.baseline) - _gpu_ms(s.by_gpu[0]) if s.by_gpu else float("-inf")


def _by_gpu_time(d: Decision) -> list[Candidate]:
    """The timed candidates by GPU time alone, ties in listed order."""
    return sorted((c for c in d.candidates[1:] if c.predicted_ms is not None and c.config is not None), key=_gpu_ms)


def _chosen(d: Decision) -> Candidate:
    """The candidate a rewriting decision took (its template and config)."""
    for c in d.candidates:
        if c.template == d.template and c.config == d.config and c.predicted_ms is not None:
            return c
    return d.candidates[0]


def _is_kernel(node: fx.Node) -> bool:
    """Nodes that cost a launch: ATen ops that are not views or size queries."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    name = str(node.target)
    if getattr(node.target, "is_view", False) or ".sym_" in name or name.startswith("sym_"):
        return False
    return hasattr(node.target, "_schema")  # an OpOverload; python builtins on sizes are not kernels


def _nodes_of(match: Any) -> set[fx.Node]:
    """Every graph node a match names (its fields, nested lists, tuples and dataclasses)."""
    found: set[fx.Node] = set()

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, fx.Node):
            found.add(v)
        elif depth and isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth - 1)
        elif depth and dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name), depth - 1)

    walk(match, 4)
    return found
