"""How a site's candidates are priced and ordered: the site and context a prediction is made in,
each template's latency model (found through the template registry), the host time a custom op
adds, and the ranking of a template's configurations, best first."""
from __future__ import annotations

import dataclasses
import json
import os
from types import ModuleType
from typing import Any

from .launch import launch_mode
from .models import Ctx, Schedule, Site
from .profile import HardwareProfile


@dataclasses.dataclass
class Candidate:
    """One way to run a site (a template's configuration, or the baseline) with its predicted ms."""

    template: str
    config: dict | None
    predicted_ms: float | None
    note: str = ""  # why a template is not a candidate, or how it was measured
    host_ms: float = 0.0  # the part of predicted_ms that is host time (host-launched; 0 in CUDA graphs)
    # the baseline: ms already taken off predicted_ms for the independent GEMMs defer_compute puts
    # under the site's collective (passes/decide.py); a measurement of the site alone lacks them
    hidden_ms: float = 0.0
    comm_ms: float = 0.0  # the baseline: its collective's predicted ms as written (all a rewrite can hide)


# ---- the context of a prediction ---------------------------------------------------------------


def group_spans_nodes(group_name: str, profile: HardwareProfile) -> bool:
    """True when the group's ranks live on more than one node. Nodes hold LOCAL_WORLD_SIZE ranks
    (torchrun) or, without it, the profile's ``topology.gpus_per_node``."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(group_name)
        ranks = dist.get_process_group_ranks(pg)
    except Exception:
        return False
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or profile.gpus_per_node)
    return len({r // max(1, per_node) for r in ranks}) > 1


def site_of(match: Any, profile: HardwareProfile) -> Site:
    return Site.from_match(match, cross_node=group_spans_nodes(match.group_name, profile))


def options_or_current(options: Any) -> Any:
    if options is not None:
        return options
    from .. import config

    return config.current()


def ctx_for(opts: Any) -> Ctx:
    return Ctx(mode=launch_mode(), first_max=opts.wave_group_first_max, last_max=opts.wave_group_last_max)


# ---- the templates' own models -----------------------------------------------------------------

# Transports that need every rank of the group on one node with peer access (symmetric memory,
# peer copies). A config is judged by its "transport" key; a template whose model says
# ``PEER_ONLY`` needs it always (unless the config's transport is "nccl").
PEER_TRANSPORTS = ("p2p", "symm_mem", "copy_engine")


def template_model(name: str) -> ModuleType | None:
    """``name``'s latency model module (templates/<name>/model.py), found through the template
    registry when asked for; None for a template without one."""
    from .. import templates

    return templates.get_model(name)


def needs_peer_access(template: str, config: dict | None) -> bool:
    """Whether ``template`` under ``config`` needs the group's ranks on one node with peer access."""
    if getattr(template_model(template), "PEER_ONLY", False):
        return not (config and config.get("transport") == "nccl")
    return bool(config) and config.get("transport") in PEER_TRANSPORTS


# ---- host time ---------------------------------------------------------------------------------


def op_overhead_ms(profile: HardwareProfile, template: str, mode: str, calls: int = 1,
                   replayed: bool = False) -> float:
    """The profile's host overhead of ``template``'s op per call in ``mode``, beyond the site's own
    (``site_host_ms``): its own measured figure when the profile has one (``per_template``,
    host-launched only), else the mode's; plus ``per_call`` for every collective call / transfer
    after the first that the op issues from Python (a chunk's event, stream switch and
    torch.distributed call: host time that grows with the chunk count).

    ``replayed``: host-launched calls replay the op from a CUDA graph (runtime.op_graphs): one
    dispatch and one graph launch whatever the chunk count, priced as a measured fraction of the
    site's own host time (``replayed.ratio_to_site``, per template where measured), so the
    overhead is that fraction minus one times ``site_host_ms`` (below 0: cheaper than the site)."""
    table = profile.raw.get("op_overhead_ms", {})
    if mode == "eager" and replayed and "replayed" in table:
        r = table["replayed"]
        ratio = float(r.get("per_template", {}).get(template, r["ratio_to_site"]))
        return (ratio - 1.0) * site_host_ms(profile, mode)
    if mode == "eager" and template in table.get("per_template", {}):
        base = float(table["per_template"][template])
    else:
        base = float(table.get(mode, 0.0))
    return base + max(0, calls - 1) * float(table.get("per_call", {}).get(mode, 0.0))


def site_host_ms(profile: HardwareProfile, mode: str) -> float:
    """Host time before a site's first kernel runs, as written or rewritten alike: host-launched,
    the GEMM and collective launches the measured window starts with (``op_overhead_ms.site``);
    0 under CUDA graphs."""
    return float(profile.raw.get("op_overhead_ms", {}).get("site", {}).get(mode, 0.0))


def host_calls(sched: Schedule) -> int:
    """Collective calls / transfers a schedule issues (its comm-lane bars; at least one)."""
    return max(1, sum(1 for e in sched.events if e.lane == "comm"))


# ---- pricing and ranking -----------------------------------------------------------------------


def schedule_for(spec: Any, match: Any, config: dict, profile: HardwareProfile, ctx: Ctx | None = None,
                 site: Site | None = None) -> Schedule | None:
    """The predicted schedule of ``match`` under ``spec``'s ``config``: our model when there is one,
    else the template's own ``spec.predict`` (a bare time, no bars)."""
    ctx = ctx or ctx_for(options_or_current(None))
    site = site or site_of(match, profile)
    model = template_model(spec.name)
    if model is not None:
        sched = model.MODEL(site, config, profile, ctx)
        if sched is not None:
            return sched
    ms = spec.predict(match, config, profile)
    return None if ms is None else Schedule(float(ms), [], None, f"{spec.name}.predict")


def price_config(spec: Any, match: Any, config: dict, profile: HardwareProfile, ctx: Ctx, site: Site,
                 op_graphs: bool = True) -> tuple[Schedule | None, float]:
    """(the GPU schedule of ``spec``'s op with ``config`` on this site, its host time per call).

    Host-launched calls replayed from a CUDA graph (``op_graphs``; GPU profiles, which have
    measured the replay; CPU references are never replayed) launch their pieces as a graph does:
    the CUDA-graph schedule, and the replay's host time. A rewritten site runs one Python custom op
    where the baseline ran plain kernels: when kernels are host-launched its dispatch, plan
    handling and stream/event work add to the site's own host time (profile "op_overhead_ms"; 0
    under CUDA graphs, which replay no host code)."""
    per_site = getattr(spec, "replays_on_host", None)  # TemplateSpec's; stand-ins may have the flag only
    replays = per_site(match) if per_site is not None else getattr(spec, "host_replay", False)
    replayed = (ctx.mode == "eager" and op_graphs and replays
                and "replayed" in profile.raw.get("op_overhead_ms", {}))
    sched = schedule_for(spec, match, config, profile, dataclasses.replace(ctx, mode="cuda_graph") if replayed
                         else ctx, site)
    if sched is None:
        return None, 0.0
    return sched, op_overhead_ms(profile, spec.name, ctx.mode, host_calls(sched), replayed) + site_host_ms(profile, ctx.mode)


def rank(spec: Any, match: Any, configs: list[dict], profile: HardwareProfile, ctx: Ctx, site: Site,
         op_graphs: bool) -> tuple[list[Candidate], list[Candidate]]:
    """(the priced candidates of ``configs``, best first; those without a price, with the reason).

    Duplicate configs count once; ties keep the order the template listed them. A config whose
    transport needs peer access is not priced on a group spanning nodes or without peer access."""
    seen, unique = set(), []
    for cfg in configs:
        text = json.dumps(cfg, sort_keys=True, default=str)
        if text not in seen:
            seen.add(text)
            unique.append(cfg)

    timed, untimed = [], []
    if not unique:
        untimed.append(Candidate(spec.name, None, None, f"{spec.name} offers no configuration for this site under "
                                                        f"profile {profile.name!r}"))
    for i, cfg in enumerate(unique):
        if needs_peer_access(spec.name, cfg) and (site.cross_node or not profile.peer_access):
            why = "the group spans nodes" if site.cross_node else f"profile {profile.name!r} has no peer access"
            untimed.append(Candidate(spec.name, cfg, None, f"needs peer access but {why}: NCCL transports only"))
            continue
        try:
            sched, overhead = price_config(spec, match, cfg, profile, ctx, site, op_graphs)
        except Exception as e:  # a model bug must not break compilation: report it
            untimed.append(Candidate(spec.name, cfg, None, f"prediction failed: {type(e).__name__}: {e}"))
            continue
        if sched is None:
            untimed.append(Candidate(spec.name, cfg, None, "no latency model for this template/kind"))
            continue
        note = sched.note + (f"; +{overhead:.3f} ms host overhead of the op ({ctx.mode})" if overhead else "")
        timed.append((sched.total_ms + overhead, i, Candidate(spec.name, cfg, sched.total_ms + overhead, note,
                                                                  host_ms=overhead)))
    timed.sort(key=lambda t: (round(t[0], 9), t[1]))  # float noise never beats the template's order
    return [c for _, _, c in timed], untimed
