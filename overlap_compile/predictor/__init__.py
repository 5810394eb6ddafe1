"""Latency predictor: hardware profiles, the physics every latency model shares, and the per-site
ranking. It prices; the pass (passes/decide.py) decides. It imports nothing from the pass.

* ``__init__.py``: the API below: profiles by name, the baseline's price, the ranking of a
  template's configurations (``Candidate``), the decision cache
* ``models.py``: what every latency model is built from (``Site``, ``Ctx``, ``Schedule``, GEMM and
  collective prices, contention, the two-lane ``pipeline``) and the baseline model
* ``profile.py``: ``HardwareProfile`` and its JSON format: validation, loading, saving, built-in
  profiles, the roofline fallback
* ``gemm_table.py``: a profile's GEMM table: measured rows, interpolated in efficiency, the roofline
  fallback; the template kernels' occupancy
* ``curves.py``: a profile's collective curves and the ring traffic factor that carries them to
  other world sizes
* ``seed.py``: the seeded (not measured) GPU profiles
* ``exhaustive.py``: ``search="exhaustive"``: measuring the candidates instead of trusting the
  prediction
* ``timeline.py``: predicted schedules and host clocks drawn as PNG

Each template's own latency model is ``templates/<name>/model.py`` (``MODEL``, optionally
``CONFIGS`` and ``PEER_ONLY``); the predictor finds it through the template registry
(``templates.get_model``) when it ranks, never at import time. The command that measures a
machine into a profile (``python -m overlap_compile profile``) sits above the predictor and the
pass: ``overlap_compile/profiling/``.

API used by passes.decide::

    load_profile(name_or_path) -> HardwareProfile        ("auto", a built-in name, or a JSON path)
    predict_baseline(match, profile) -> float | None     (ms of the site as written)
    rank_configs(spec, match, profile) -> list[Candidate] (best first)

Both prediction functions also take ``options=`` (an ``overlap_compile.Options``; default:
``config.current()``): it supplies FlashOverlap's pruning bounds and the search mode.

Decisions are deterministic functions of (site signature, profile content, options, launch mode,
group topology) and are cached on exactly that key (``clear_cache()`` empties it), so recompiles
do not repeat a search and every rank of a group ranks the same way.

Groups that span nodes (or machines without peer access) get NCCL-transport candidates only:
a candidate whose transport needs peer access is listed with the reason and no prediction.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
from types import ModuleType
from typing import Any

from .launch import launch_mode
from .models import Ctx, Schedule, Site, baseline, hidden_beside
from .profile import (
    HardwareProfile,
    ProfileError,
    builtin_names,
    builtin_path,
    detect_profile_name,
    profile_from_dict,
    read_profile,
    roofline_profile,
)

__all__ = [
    "load_profile", "predict_baseline", "rank_configs", "clear_cache", "HardwareProfile", "ProfileError",
    "site_of", "schedule_for", "launch_mode", "loaded_profile", "model_configs", "op_overhead_ms",
    "site_host_ms", "host_calls", "Candidate", "template_model", "needs_peer_access", "hidden_by_deferred",
    "baseline_comm_ms",
]

_lock = threading.RLock()
_profiles: dict[Any, HardwareProfile] = {}
_cache: dict[tuple, Any] = {}


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


# ---- profiles ---------------------------------------------------------------------------------


def load_profile(name: str | HardwareProfile | None = "auto") -> HardwareProfile:
    """"auto": the built-in profile of the detected GPU (H200, H100), ``cpu-gloo`` without CUDA,
    else a roofline from the device's properties (named ``roofline:<gpu>``); a built-in name; or a
    path to a JSON file. Errors (unknown name, missing or malformed file) raise ProfileError."""
    if isinstance(name, HardwareProfile):
        return name
    if name is None or name == "auto":
        how, what = detect_profile_name()
        if how == "roofline":
            key = ("roofline", str(getattr(what, "name", "")))
            with _lock:
                if key not in _profiles:
                    _profiles[key] = profile_from_dict(roofline_profile(what), source=f"roofline of {key[1]}")
                return _profiles[key]
        name = what
    if not isinstance(name, str) or not name:
        raise ProfileError(f"profile {name!r}: expected 'auto', a built-in name {builtin_names()} or a JSON path")
    looks_like_path = name.endswith(".json") or os.sep in name or (os.altsep and os.altsep in name)
    if looks_like_path:
        path = os.path.abspath(os.path.expanduser(name))
    elif name in builtin_names():
        path = builtin_path(name)
    else:
        raise ProfileError(f"profile {name!r}: not a built-in profile ({', '.join(builtin_names())}) "
                           f"and not a path to a .json file")
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    with _lock:
        if key is not None and key in _profiles:
            return _profiles[key]
    prof = read_profile(path)
    if key is not None:
        with _lock:
            _profiles[key] = prof
    return prof


def loaded_profile(name: str) -> HardwareProfile:
    """A profile by name: built-in, a path, or any profile this process has already loaded under
    that name (e.g. a JSON file whose ``name`` the Report shows). For tools such as the timeline;
    the compiler pass always goes through ``load_profile``."""
    try:
        return load_profile(name)
    except ProfileError:
        with _lock:
            hits = [p for p in _profiles.values() if p.name == name]
        if hits:
            return hits[-1]
        raise


def clear_cache() -> None:
    """Forget cached decisions and loaded profiles."""
    with _lock:
        _cache.clear()
        _profiles.clear()


# ---- context of a decision ---------------------------------------------------------------------


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


def _options(options: Any) -> Any:
    if options is not None:
        return options
    from .. import config

    return config.current()


def _ctx(opts: Any) -> Ctx:
    return Ctx(mode=launch_mode(), first_max=opts.wave_group_first_max, last_max=opts.wave_group_last_max)


def _key(what: str, match: Any, site: Site, profile: HardwareProfile, opts: Any, ctx: Ctx) -> tuple:
    return (what, match.signature(), profile.key, ctx, site.cross_node, opts.search, opts.op_graphs)


# ---- the API passes.decide uses ---------------------------------------------------------------


def predict_baseline(match: Any, profile: HardwareProfile | None, options: Any = None) -> float | None:
    """Predicted ms of the site as written (GEMM + collective); None without a profile or model.
    With ``search="exhaustive"`` the measured time where it could be measured."""
    if profile is None or getattr(match, "unsupported", None):
        return None
    opts = _options(options)
    site = site_of(match, profile)
    ctx = _ctx(opts)
    key = _key("baseline", match, site, profile, opts, ctx)
    with _lock:
        if key in _cache:
            return _cache[key]
    sched = baseline(site, profile, ctx)
    ms = None if sched is None else sched.total_ms + site_host_ms(profile, ctx.mode)
    if opts.search == "exhaustive" and ms is not None:
        from . import exhaustive

        measured = exhaustive.measure_baseline(match, opts, profile)
        if isinstance(measured, float):
            ms = measured
    with _lock:
        _cache[key] = ms
    return ms


def baseline_comm_ms(match: Any, profile: HardwareProfile | None, options: Any = None) -> float:
    """The predicted ms of the site's collective(s) as written: what overlap can hide at most."""
    if profile is None or getattr(match, "unsupported", None):
        return 0.0
    sched = baseline(site_of(match, profile), profile, _ctx(_options(options)))
    return 0.0 if sched is None else sum(e.end - e.start for e in sched.events if e.lane == "comm")


def hidden_by_deferred(match: Any, profile: HardwareProfile | None, gemms: list[tuple[int, int, int, int]],
                       options: Any = None) -> tuple[float, float]:
    """(ms of the site as written that independent GEMMs hide when passes/defer_compute.py puts
    them between its collective's start and its wait, those GEMMs' ms alone). ``gemms``:
    (batch, M, N, K) of each, in the site's dtype."""
    if profile is None or not gemms or getattr(match, "unsupported", None):
        return 0.0, 0.0
    dtype = site_of(match, profile).dtype
    compute = sum(b * profile.gemm.ms(m, n, k, dtype) for b, m, n, k in gemms)
    return hidden_beside(baseline_comm_ms(match, profile, options), compute, profile), compute


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


def rank_configs(spec: Any, match: Any, profile: HardwareProfile | None, options: Any = None) -> list:
    """Every configuration ``spec.candidates`` offers for the site with its predicted ms, best
    first (ties: the order the template listed them). Candidates that cannot run here (peer
    transport on a group spanning nodes) or have no model come last with the reason in ``note``.
    """
    from .. import config

    if profile is None:
        return []
    opts = _options(options)
    site = site_of(match, profile)
    ctx = _ctx(opts)
    key = _key(f"rank:{spec.name}", match, site, profile, opts, ctx)
    with _lock:
        if key in _cache:
            return copy.deepcopy(_cache[key])

    with config.using(opts):  # spec.candidates reads config.current() for its bounds
        configs = spec.candidates(match, profile)
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
            sched, overhead = price_config(spec, match, cfg, profile, ctx, site, bool(opts.op_graphs))
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
    ranked = [c for _, _, c in timed]
    if opts.search == "exhaustive" and ranked:
        from . import exhaustive

        ranked = exhaustive.measure_candidates(spec, match, ranked, opts, profile)
    ranked += untimed
    with _lock:
        _cache[key] = copy.deepcopy(ranked)
    return ranked


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


def schedule_for(spec: Any, match: Any, config: dict, profile: HardwareProfile, ctx: Ctx | None = None,
                 site: Site | None = None) -> Schedule | None:
    """The predicted schedule of ``match`` under ``spec``'s ``config``: our model when there is one,
    else the template's own ``spec.predict`` (a bare time, no bars)."""
    ctx = ctx or _ctx(_options(None))
    site = site or site_of(match, profile)
    model = template_model(spec.name)
    if model is not None:
        sched = model.MODEL(site, config, profile, ctx)
        if sched is not None:
            return sched
    ms = spec.predict(match, config, profile)
    return None if ms is None else Schedule(float(ms), [], None, f"{spec.name}.predict")


def model_configs(template: str, match: Any, profile: HardwareProfile | None, options: Any = None
                  ) -> list[dict] | None:
    """The candidate configs ``template``'s latency model searches itself (its model's ``CONFIGS``:
    signal_reorder's FlashOverlap Algorithm 1 wave-group partitions per kernel config); None
    without a profile (the spec then offers its default) or without such a search."""
    if profile is None or getattr(match, "unsupported", None):
        return None
    model = template_model(template)
    search = getattr(model, "CONFIGS", None)
    if search is None:
        return None
    opts = _options(options)
    site = site_of(match, profile)
    ctx = _ctx(opts)
    key = _key(f"configs:{template}", match, site, profile, opts, ctx)
    with _lock:
        if key in _cache:
            return copy.deepcopy(_cache[key])
    configs = search(site, profile, ctx)
    with _lock:
        _cache[key] = copy.deepcopy(configs)
    return configs


# ---- the templates' own models ----------------------------------------------------------------

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
