"""Latency predictor: hardware profiles, the physics every latency model shares, and the per-site
ranking. It prices; the pass (passes/decide.py) decides. It imports nothing from the pass.

    load_profile(name_or_path) -> HardwareProfile        ("auto", a built-in name, or a JSON path)
    predict_baseline(match, profile) -> float | None     (ms of the site as written)
    rank_configs(spec, match, profile) -> list[Candidate] (best first)

These also take ``options=`` (default ``config.current()``). Answers are deterministic in (site
signature, profile, options, launch mode, group topology) and cached on that key
(``decision_cache``, ``clear_cache()``), so every rank ranks the same. Groups spanning nodes get
NCCL-transport candidates only. Each template's model is ``templates/<name>/model.py``, found
through the registry when ranking.
"""
from __future__ import annotations

import os
from typing import Any

from . import decision_cache, profile_cache, ranking
from .launch import launch_mode
from .models import baseline, hidden_beside
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
from .ranking import (
    PEER_TRANSPORTS,
    Candidate,
    ctx_for,
    group_spans_nodes,
    host_calls,
    needs_peer_access,
    op_overhead_ms,
    options_or_current,
    price_config,
    schedule_for,
    site_host_ms,
    site_of,
    template_model,
)

__all__ = [
    "load_profile", "predict_baseline", "rank_configs", "clear_cache", "HardwareProfile", "ProfileError",
    "site_of", "schedule_for", "launch_mode", "loaded_profile", "model_configs", "op_overhead_ms",
    "site_host_ms", "host_calls", "Candidate", "template_model", "needs_peer_access", "hidden_by_deferred",
    "baseline_comm_ms",
]


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
            gpu = str(getattr(what, "name", ""))
            return profile_cache.get_or_make(
                ("roofline", gpu), lambda: profile_from_dict(roofline_profile(what), source=f"roofline of {gpu}"))
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
    return profile_cache.get_or_make(key, lambda: read_profile(path))


def loaded_profile(name: str) -> HardwareProfile:
    """A profile by name: built-in, a path, or any profile this process has already loaded under
    that name (e.g. a JSON file whose ``name`` the Report shows). For tools such as the timeline;
    the compiler pass always goes through ``load_profile``."""
    try:
        return load_profile(name)
    except ProfileError:
        hit = profile_cache.named(name)
        if hit is not None:
            return hit
        raise


def clear_cache() -> None:
    """Forget cached decisions and loaded profiles."""
    decision_cache.clear()
    profile_cache.clear()


# ---- the API passes.decide uses ---------------------------------------------------------------


def predict_baseline(match: Any, profile: HardwareProfile | None, options: Any = None) -> float | None:
    """Predicted ms of the site as written (GEMM + collective); None without a profile or model.
    With ``search="exhaustive"`` the measured time where it could be measured."""
    if profile is None or getattr(match, "unsupported", None):
        return None
    opts = options_or_current(options)
    site = site_of(match, profile)
    ctx = ctx_for(opts)
    key = decision_cache.key("baseline", match, site, profile, opts, ctx)
    cached = decision_cache.get(key)
    if cached is not decision_cache.MISSING:
        return cached
    sched = baseline(site, profile, ctx)
    ms = None if sched is None else sched.total_ms + site_host_ms(profile, ctx.mode)
    if opts.search == "exhaustive" and ms is not None:
        from . import exhaustive

        measured = exhaustive.measure_baseline(match, opts, profile)
        if isinstance(measured, float):
            ms = measured
    decision_cache.put(key, ms)
    return ms


def baseline_comm_ms(match: Any, profile: HardwareProfile | None, options: Any = None) -> float:
    """The predicted ms of the site's collective(s) as written: what overlap can hide at most."""
    if profile is None or getattr(match, "unsupported", None):
        return 0.0
    sched = baseline(site_of(match, profile), profile, ctx_for(options_or_current(options)))
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


def rank_configs(spec: Any, match: Any, profile: HardwareProfile | None, options: Any = None) -> list:
    """Every configuration ``spec.candidates`` offers for the site with its predicted ms, best
    first (ties: the order the template listed them). Candidates that cannot run here (peer
    transport on a group spanning nodes) or have no model come last with the reason in ``note``.
    """
    from .. import config

    if profile is None:
        return []
    opts = options_or_current(options)
    site = site_of(match, profile)
    ctx = ctx_for(opts)
    key = decision_cache.key(f"rank:{spec.name}", match, site, profile, opts, ctx)
    cached = decision_cache.get(key)
    if cached is not decision_cache.MISSING:
        return cached

    with config.using(opts):  # spec.candidates reads config.current() for its bounds
        configs = spec.candidates(match, profile)
    ranked, untimed = ranking.rank(spec, match, configs, profile, ctx, site, bool(opts.op_graphs))
    if opts.search == "exhaustive" and ranked:
        from . import exhaustive

        ranked = exhaustive.measure_candidates(spec, match, ranked, opts, profile)
    ranked += untimed
    decision_cache.put(key, ranked)
    return ranked


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
    opts = options_or_current(options)
    site = site_of(match, profile)
    ctx = ctx_for(opts)
    key = decision_cache.key(f"configs:{template}", match, site, profile, opts, ctx)
    cached = decision_cache.get(key)
    if cached is not decision_cache.MISSING:
        return cached
    configs = search(site, profile, ctx)
    decision_cache.put(key, configs)
    return configs
