"""settle: a site the predictor cannot call is timed on its group and decided by what it measures.

A site whose predicted gain lies within the model error (``uncertain``) is measured once, on its
own group, while the graph compiles: the site as written and each template's best configuration,
on random operands of its shapes (predictor/exhaustive.py), replayed from a CUDA graph where
Inductor captures one, else host-launched behind queued GPU work where host_pacing shows enough
lead to hide the op's host time (``_timing``). Every rank measures the same sites in order and
takes the slowest rank's time, so all ranks decide the same; the fastest rewrite clearing
min_speedup and min_saved_us over the site as written (timed before and after them, the better
time kept) wins. A measurement that turns down every rewrite the model predicted to clear
min_speedup is taken once more, each item keeping its better time.
Only GPU groups are measured; off with ``measure_uncertain=False``, ``force_template`` or
``search`` other than "predict"; cached per (group, site, mode, profile).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

from .. import predictor
from ..config import Options
from ..predictor import Candidate
from .decision import BASELINE, Decision, required_gain, saves_too_little

_cache: dict[tuple, list[float] | str] = {}
_lock = threading.Lock()


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def settle(decisions: list[Decision], options: Options, profile: Any) -> list[Decision]:
    """``decisions`` with each site inside the model's error band decided by its measured gain."""
    if (profile is None or not options.measure_uncertain or options.search != "predict"
            or options.force_template is not None):
        return decisions
    needed = required_gain(options, profile)
    return [_settle_one(d, options, profile, needed) for d in decisions]


MAX_TRIES = 3  # rewrites timed per site at most: each is captured and replayed while the graph compiles


def uncertain(d: Decision, options: Options, needed: float) -> tuple[Candidate, list[Candidate], str] | None:
    """(baseline, rewrites to time, why) of a site whose decision the prediction cannot carry, the
    model error ``err`` being ``needed / min_speedup - 1``:

    * kept as written, its best predicted gain within the model error of min_speedup, either side
      (min_speedup / (1 + err) up to the bar ``needed``): each template's best predicted
      configuration predicted to clear min_speedup / (1 + err), fastest first (below min_speedup
      too: sites predicted just under it can measure well over it);
    * rewritten in a captured graph while another template's best configuration is predicted
      within the model error of the chosen one: the chosen one and those rivals;
    * host-launched and rewritten, its predicted gain under the bar grown by the op's share of
      host time in its price (``doubtful_rewrite``): the chosen configuration.

    At most MAX_TRIES rewrites per site. None for any other site."""
    if d.match.unsupported or not d.candidates:
        return None
    base = d.candidates[0]
    if base.template != BASELINE or not base.predicted_ms:
        return None
    err = needed / options.min_speedup - 1.0
    timed = sorted((c for c in d.candidates[1:] if c.predicted_ms), key=lambda c: c.predicted_ms)
    if d.rewrites:
        return _rivals(d, timed, err) or doubtful_rewrite(d, needed)
    low = options.min_speedup / (1.0 + err)
    if not timed or not low <= base.predicted_ms / timed[0].predicted_ms < needed:
        return None
    tries = _best_per_template(c for c in timed if base.predicted_ms / c.predicted_ms >= low)
    why = (f"predicted {base.predicted_ms / timed[0].predicted_ms:.2f}x, under the bar {needed:.2f}x and within "
           f"the model error of min_speedup {options.min_speedup}")
    return base, tries, why


def _best_per_template(cands, limit: int = MAX_TRIES) -> list[Candidate]:
    """At most ``limit`` of ``cands`` (fastest predicted first): each template's best, then the
    next configurations in predicted order."""
    firsts, rest, seen = [], [], set()
    for c in cands:
        (rest if c.template in seen else firsts).append(c)
        seen.add(c.template)
    return (firsts + rest)[:limit]


def _chosen(d: Decision) -> Candidate | None:
    """The priced candidate a rewriting decision took."""
    return next((c for c in d.candidates[1:] if c.template == d.template and c.config == d.config
                 and c.predicted_ms), None)


def label(c: Candidate, before: list[Candidate]) -> str:
    """How ``measured["tried"]`` names a try: its template, with its config where an earlier try
    was of the same template."""
    if all(b.template != c.template for b in before):
        return c.template
    return f"{c.template} {json.dumps(c.config, sort_keys=True, separators=(',', ':'))}"


def _rivals(d: Decision, timed: list[Candidate], err: float) -> tuple[Candidate, list[Candidate], str] | None:
    """A rewrite in a captured graph with other candidates (templates or configurations) predicted
    within the model error of it: (baseline, [chosen, rivals], why), else None."""
    chosen = _chosen(d)
    if predictor.launch_mode() != "cuda_graph" or chosen is None:
        return None
    rivals = _best_per_template((c for c in timed if c is not chosen
                                 and c.predicted_ms <= chosen.predicted_ms * (1.0 + err)), MAX_TRIES - 1)
    if not rivals:
        return None
    names = ", ".join(f"{label(c, [chosen] + rivals[:i])} ({chosen.predicted_ms / c.predicted_ms:.2f}x of its time)"
                      for i, c in enumerate(rivals))
    return d.candidates[0], [chosen] + rivals, (f"rewritten with {d.template}; {names} predicted within the "
                                                f"model error ({err:.0%}) of it")


def doubtful_rewrite(d: Decision, needed: float) -> tuple[Candidate, list[Candidate], str] | None:
    """A host-launched rewrite the prediction cannot carry: (baseline, [chosen], why), else None.

    The host part of a host-launched price is its least certain part (the host time a replayed op
    exposes varies from one shape to the next). So a rewrite whose predicted gain is under the bar
    times (1 + the host share of the op's price) is measured too, and goes back to the site as
    written if it does not clear min_speedup."""
    from .. import predictor

    if predictor.launch_mode() != "eager":
        return None
    base = d.candidates[0]
    chosen = _chosen(d)
    if chosen is None:
        return None
    gain, share = base.predicted_ms / chosen.predicted_ms, chosen.host_ms / chosen.predicted_ms
    if gain >= needed * (1 + share):
        return None
    return base, [chosen], (f"rewritten for a predicted {gain:.2f}x, under the bar {needed:.2f}x grown by the op's "
                            f"host share of its price ({share:.0%}), host time being the least certain part")


def _settle_one(d: Decision, options: Options, profile: Any, needed: float) -> Decision:
    found = uncertain(d, options, needed)
    if found is None:
        return d
    base, tries, band = found
    timing = _timing(d, tries)
    got = _measured(d, tries, options, profile, timing == "queued")
    if isinstance(got, str):
        note = "within the model error" if not d.rewrites else "a rewrite within the model's or the host's error"
        return dataclasses.replace(d, measured={"note": f"{note}; {got}"})
    from ..predictor.exhaustive import FAILED_MS

    if _against_prediction(got, base, tries, options, FAILED_MS):
        # Interference only adds time, and a rewrite is timed once where the site as written is
        # timed twice: a single slow run (a peer late into the timing) reads as a loss. Timed
        # again, each item keeps its better time; a failure in either run stays a failure.
        again = _measured(d, tries, options, profile, timing == "queued", attempt=2)
        if not isinstance(again, str):
            got = [max(a, b) if max(a, b) >= FAILED_MS else min(a, b) for a, b in zip(got, again)]
    # the site as written is timed first and last: the rewrite must beat the better of the two,
    # so a gain within the timing's own drift (decode-sized sites: a few microseconds) is none
    first, times, last = got[0], got[1:-1], got[-1]
    written = min(first, last) if max(first, last) < FAILED_MS else max(first, last)
    # the site alone, as measured, lacks the compute defer_compute puts under its collective in
    # the graph: take off what the baseline's price took off for it
    base_ms = written - base.hidden_ms if written < FAILED_MS else written
    i = min(range(len(tries)), key=lambda j: (times[j], j))
    best, ms = tries[i], times[i]
    predicted_gain = base.predicted_ms / best.predicted_ms
    ok = base_ms < FAILED_MS and ms < FAILED_MS
    gain = base_ms / ms if ok else None
    measured = {"baseline_ms": base_ms, "template": best.template, "config": best.config, "ms": ms,
                "predicted_gain": predicted_gain, "measured_gain": gain, "settled": True, "timing": timing,
                "tried": {label(c, tries[:i]): t for i, (c, t) in enumerate(zip(tries, times))}}
    if timing == "queued":
        band += (f"; timed on the GPU with the host ahead (in this host-launched graph the "
                 f"{d.host_clock['lead']:.3f} ms of GPU work queued before the site hides the op's host time)")
    if gain is not None and gain >= options.min_speedup and not saves_too_little(base_ms, ms, options):
        return Decision(d.match, best.template, best.config,
                        f"{band}; measured on the group: {best.template} {gain:.2f}x ({ms:.3f} vs {base_ms:.3f} ms) "
                        f">= min_speedup {options.min_speedup}", d.candidates, d.host_clock, measured)
    what = ("failed to run on some rank" if gain is None else
            f"measured on the group: {best.template} {gain:.2f}x ({ms:.3f} vs {base_ms:.3f} ms)"
            + (f", saving under min_saved_us {options.min_saved_us:g}" if gain >= options.min_speedup else ""))
    if d.rewrites:  # the measurement does not bear the rewrite out: the site as written
        return Decision(d.match, BASELINE, None, f"{band}; {what} < min_speedup {options.min_speedup}: kept as written",
                        d.candidates, d.host_clock, measured)
    return dataclasses.replace(d, reason=f"{d.reason}; {what}: kept as written", measured=measured)


def _against_prediction(got: list[float], base: Candidate, tries: list[Candidate], options: Options,
                        failed_ms: float) -> bool:
    """Whether the measurement turns down every rewrite the model predicted to clear min_speedup
    (none failed: a failure is not a timing's noise)."""
    written = min(got[0], got[-1])
    if max(got) >= failed_ms:
        return False
    predicted = [base.predicted_ms / c.predicted_ms >= options.min_speedup for c in tries]
    return any(predicted) and all(written - base.hidden_ms < options.min_speedup * t for t in got[1:-1])


def _timing(d: Decision, tries: list[Candidate]) -> str:
    """How the site is timed: "graph" (CUDA-graph replays) where Inductor captures the graph;
    host-launched, "queued" (the GPU's time alone, each call issued while the GPU is busy) where
    host_pacing's clocks put more GPU work ahead of the site than any try's host time, so that
    time hides in the graph as it does in the timing; else "idle" (from an idle GPU: the host's
    launch time counts, as it does at the head of a graph)."""
    if predictor.launch_mode() == "cuda_graph":
        return "graph"
    lead = (d.host_clock or {}).get("lead", 0.0)
    return "queued" if lead > 0 and all(c.host_ms <= lead for c in tries) else "idle"


def _measured(d: Decision, tries: list[Candidate], options: Options, profile: Any,
              queued: bool, attempt: int = 1) -> list[float] | str:
    """[baseline ms, ms of each of ``tries``, baseline ms again] measured on the site's group, or
    why not (``attempt``: a fresh measurement of the same items, cached apart)."""
    from ..predictor import exhaustive

    m = d.match
    items = [(BASELINE, None)] + [(c.template, c.config) for c in tries] + [(BASELINE, None)]
    key = (m.group_name, m.signature(), repr(items), predictor.launch_mode(), getattr(profile, "key", None),
           options.op_graphs, options.signal_timeout_ms, queued, exhaustive.measure_source(), attempt)
    with _lock:
        if key in _cache:
            return _cache[key]
    got = exhaustive.measure_items(items, m, options, gpu_only=True, queued=queued, profile=profile)
    with _lock:
        _cache[key] = got
    return got
