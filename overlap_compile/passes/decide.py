"""decide: every site of a graph at once -> one Decision per site. Never touches the graph.

For each site the baseline (GEMM then collective, as written) is always a candidate. Each
template allowed by ``options.templates`` that supports the site contributes its candidate
configurations with predicted times; the fastest wins only if baseline / best >= min_speedup
and it saves at least min_saved_us.
``force_template`` skips the prediction contest (tests, experiments). Every site left as it is
gets a reason. The predictor prices (``predictor.rank_configs`` hands out its ``Candidate``s);
this module decides. ``Decision`` and the bar a gain must clear are in decision.py, which
host_pacing.py (the host-launched graph's second look) shares.
"""
from __future__ import annotations

import json
from typing import Any

from .. import predictor, templates
from ..config import Options
from ..predictor import Candidate
from ..templates.base import gpu_profile
from . import host_pacing, settle
from .decision import BASELINE, Decision, model_error, required_gain, saves_too_little
from .defer_compute import deferrable, gemm_shape
from .matches import Match


def decide(matches: list[Match], options: Options, profile: Any = None, graph: Any = None) -> list[Decision]:
    """One Decision per match. Each site on its own first (``_decide_one``); then, for a
    host-launched ``graph``, the sites whose op host time would hide behind the GPU work queued
    before them (passes/host_pacing.py); then the sites kept as written whose predicted gain is
    within the model's error of the bar, by measuring them on their group (passes/settle.py).
    Sites of a symbolic M get both per bucket, at the bucket's M (symbolic_decide.second_look)."""
    under = _deferred_gemms(matches, graph) if options.moves_compute and profile is not None else {}
    decisions = [_decide_one(m, options, profile, under.get(id(m), [])) for m in matches]
    if graph is not None and profile is not None:
        decisions = host_pacing.pace(graph, decisions, options, profile)
    decisions = settle.settle(decisions, options, profile)
    if any(getattr(m, "rows", None) is not None for m in matches):
        from .symbolic_decide import second_look

        decisions = second_look(decisions, graph, options, profile, _decide_one, host_pacing.pace,
                                settle.settle)
    if options.search == "measure" and profile is not None:
        for d in decisions:
            d.measured = _measure(d, options, profile)
    return decisions


def _measure(d: Decision, options: Options, profile: Any) -> dict | None:
    """``search="measure"``: the decision stands as predicted; the site as written and the rewrite
    it weighed (chosen, else the best predicted) are timed once on the group, so the Report shows
    predicted and measured gain side by side, and where the predictor is wrong."""
    if d.match.unsupported:
        return None
    base = next((c for c in d.candidates if c.template == BASELINE), None)
    timed = [c for c in d.candidates if c.template != BASELINE and c.predicted_ms is not None]
    weighed = ([c for c in timed if c.template == d.template and c.config == d.config] or
               sorted(timed, key=lambda c: c.predicted_ms))[:1]
    if base is None or base.predicted_ms is None or not weighed:
        return None
    (cand,) = weighed
    from ..predictor import exhaustive

    got = exhaustive.measure_items([(BASELINE, None), (cand.template, cand.config)], d.match, options,
                                   profile=profile)
    if isinstance(got, str):
        return {"note": got}
    base_ms, ms = got
    ok = base_ms < exhaustive.FAILED_MS and ms < exhaustive.FAILED_MS
    return {"baseline_ms": base_ms, "template": cand.template, "config": cand.config, "ms": ms,
            "predicted_gain": base.predicted_ms / cand.predicted_ms,
            "measured_gain": base_ms / ms if ok else None}


def _deferred_gemms(matches: list[Match], graph: Any) -> dict[int, list[tuple[int, int, int, int]]]:
    """id(match) -> (batch, M, N, K) of each GEMM that passes/defer_compute.py would put under the
    site's collective were the site left as written (a backward's weight gradients)."""
    if graph is None:
        return {}
    under = deferrable(graph)
    out = {}
    for m in matches:
        if m.unsupported or m.kind == "moe":
            continue
        shapes = [gemm_shape(n) for n in under.get(m.anchor().name, [])]
        if shapes and all(s is not None for s in shapes):
            out[id(m)] = shapes
    return out


def _decide_one(match: Match, options: Options, profile: Any,
                deferred: list[tuple[int, int, int, int]] | None = None) -> Decision:
    if match.unsupported:
        return Decision(match, BASELINE, None, match.unsupported, [])
    if getattr(match, "rows", None) is not None:  # symbolic row count: one decision per M bucket
        from .symbolic_decide import decide_buckets

        return decide_buckets(match, options, profile, _decide_one)
    base_ms = predictor.predict_baseline(match, profile, options) if profile is not None else None
    base_host = predictor.site_host_ms(profile, predictor.launch_mode()) if base_ms is not None else 0.0
    hidden, note = 0.0, ""
    if base_ms is not None and deferred:
        hidden, alone = predictor.hidden_by_deferred(match, profile, deferred, options)
        base_ms -= hidden
        note = (f"as written, defer_compute puts {len(deferred)} independent GEMM(s) ({alone:.3f} ms) under its "
                f"collective, hiding {hidden:.3f} ms of the site")
    comm = predictor.baseline_comm_ms(match, profile, options) if base_ms is not None else 0.0
    cands = [Candidate(BASELINE, None, base_ms, note, host_ms=base_host, hidden_ms=hidden, comm_ms=comm)]

    forced = options.force_template
    if forced == BASELINE:
        return Decision(match, BASELINE, None, "force_template='baseline'", cands)
    if forced is not None:
        problem = _why_not(forced, match, options) or _gpu_refusal(forced, match, profile)
        if problem:
            return Decision(match, BASELINE, None, f"force_template={forced!r} cannot take this site: {problem}", cands)
        spec = templates.get_spec(forced)
        if options.force_config is not None:
            config = json.loads(options.force_config)
            try:
                spec.plan(match, config, options.signal_timeout_ms)
            except ValueError as e:
                return Decision(match, BASELINE, None, f"force_config {config} cannot take this site: {e}", cands)
            sched = predictor.schedule_for(spec, match, config, profile) if profile is not None else None
            cands.append(Candidate(forced, config, sched.total_ms if sched is not None else None,
                                   sched.note if sched is not None else "no latency model for this config"))
            return Decision(match, forced, config, f"force_template={forced!r}, force_config={config}", cands)
        ranked = predictor.rank_configs(spec, match, profile, options) if profile is not None else []
        config = next((c.config for c in ranked if c.config is not None), None) or spec.default_config(match)
        cands += ranked or [Candidate(forced, config, None)]
        return Decision(match, forced, config, f"force_template={forced!r}", cands)

    for name in options.templates:
        problem = _why_not(name, match, options) or _no_gpu_path(name, profile) or _gpu_refusal(name, match, profile)
        if problem:
            cands.append(Candidate(name, None, None, problem))
            continue
        cands += predictor.rank_configs(templates.get_spec(name), match, profile, options) if profile is not None else [
            Candidate(name, None, None, "no hardware profile")
        ]
    timed = [c for c in cands[1:] if c.predicted_ms is not None]
    if base_ms is None or not timed:
        return Decision(match, BASELINE, None, "no prediction available for this site; kept as written", cands)
    best = min(timed, key=lambda c: c.predicted_ms)
    gain = base_ms / best.predicted_ms
    margin = model_error(profile)
    needed = required_gain(options, profile)
    if gain < needed:
        why = f"min_speedup {options.min_speedup}" + (f" x (1 + the profile's model error {margin:.1%})" if margin else "")
        return Decision(
            match, BASELINE, None,
            f"best rewrite {best.template} predicted {best.predicted_ms:.3f} ms vs baseline {base_ms:.3f} ms"
            f"{f' ({note})' if note else ''}: gain {gain:.2f}x < {why}",
            cands,
        )
    if saves_too_little(base_ms, best.predicted_ms, options):
        return Decision(match, BASELINE, None,
                        f"best rewrite {best.template} predicted {best.predicted_ms:.3f} ms vs baseline {base_ms:.3f} ms: "
                        f"saves under min_saved_us {options.min_saved_us:g}", cands)
    return Decision(match, best.template, best.config,
                    f"predicted {gain:.2f}x over baseline ({best.predicted_ms:.3f} vs {base_ms:.3f} ms"
                    f"{f'; {note}' if note else ''})", cands)


def _no_gpu_path(name: str, profile: Any) -> str | None:
    """Under a GPU profile, a template with no GPU implementation is no candidate."""
    if gpu_profile(profile) and not templates.get_spec(name).gpu_implemented:
        return f"template {name!r} has no GPU implementation yet (its reference runs, slowly)"
    return None


def _gpu_refusal(name: str, match: Match, profile: Any) -> str | None:
    """Under a GPU profile, a template whose GPU kernels are not shown right on this kind of site
    leaves it as written (also when forced): a wrong answer must never be the price of a rewrite."""
    if gpu_profile(profile) and name in templates.names():
        return templates.get_spec(name).gpu_refusal(match)
    return None


def _why_not(name: str, match: Match, options: Options) -> str | None:
    if name not in templates.names():
        return f"template {name!r} is not implemented yet (implemented: {', '.join(templates.names())})"
    if name not in options.templates and options.force_template != name:
        return f"template {name!r} is not in options.templates"
    return templates.get_spec(name).supports(match)
