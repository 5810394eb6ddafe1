"""The decision of a site whose row count M is symbolic: one choice per M bucket.

The buckets (predictor/buckets.py) come from M's size hint and the compile's bounds. For each,
the site is priced as a static site at the bucket's representative M (a whole number of GEMM
tiles per ring piece where the bucket holds one) by the same per-site decision as any static
site (decide._decide_one), and at its smallest and largest M. Where the ends choose another
template, or the representative's rewrite is priced slower than the site as written at an end,
the bucket is cut in two (predictor/buckets.split) and each half decided again; a bucket that
cannot be cut takes, of the three choices and "as written", the one priced least summed over the three M.
``second_look`` then gives each bucket what decide gives a static
graph after that: per bucket, every site of the graph is made static at its M there (sites of
another symbolic M scaled by the ratio of the hints) and passed through the host-launch pacing
and, for the symbolic sites, the measuring of uncertain sites, so a bucket chooses what a static
compile at its representative M would; its ends are decided the same way (paced, and timed
where the model cannot call them) and the bucket is cut where they disagree, as in the first
look. Neighbouring buckets with the same choice are merged into one table entry; the site is rewritten (template ``BUCKETED``: templates/bucketed.py's op)
when any bucket rewrites. ``priced`` holds the candidates of the bucket holding the size hint,
for the Report, and ``buckets`` one row per bucket.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ..config import Options
from ..predictor.buckets import Bucket, split
from ..predictor.buckets import buckets as make_buckets
from .decision import BASELINE, Decision
from .matches import AllGatherGemmMatch, Match
from .symbolic_find import unit_rows

BUCKETED = "bucketed"


@dataclasses.dataclass
class BucketedDecision(Decision):
    # one row per bucket: lo, hi, at (the M priced), template, config, baseline_ms, chosen_ms, reason
    buckets: list = dataclasses.field(default_factory=list)
    # what the op's table holds: [{"max_m", "template", "config"}], merged
    table: list = dataclasses.field(default_factory=list)
    priced: list = dataclasses.field(default_factory=list)
    # (Bucket, the static Decision at its representative M) per bucket, for decide's second look
    per_bucket: list = dataclasses.field(default_factory=list, repr=False)


def at_rows(match: Match, m: int) -> Match:
    """The symbolic site as a static one of M rows (what the predictor prices)."""
    rows = match.rows
    kw: dict[str, Any] = dict(m=m, rows=None, stripes=rows.stripes_at(m, match.world_size) or match.stripes)
    if isinstance(match, AllGatherGemmMatch):
        kw["gathered_shape"] = (m, match.k)
    else:
        kw["view_shape"] = (m, match.n)
    return dataclasses.replace(match, **kw)


# rows of cuBLAS's usual bf16/fp16 tile on Hopper (128 x 256)
CUBLAS_TILE_ROWS = 128


def _align(match: Match) -> int:
    """Rows a bucket's representative is rounded to: a whole cuBLAS tile in each of the W pieces a
    template cuts (p2p_ring's chunks, the reduce-scatter's stripes) and in the whole GEMM."""
    step = unit_rows(match.rows, match.world_size)
    tile = CUBLAS_TILE_ROWS * max(1, match.world_size)
    return step * tile // math.gcd(step, tile)


def decide_buckets(match: Match, options: Options, profile: Any, decide_one: Callable) -> Decision:
    rows = match.rows
    step, align = unit_rows(rows, match.world_size), _align(match)
    per_bucket = []

    def at(m: int) -> Decision:
        return decide_one(at_rows(match, m), options, profile, [])

    for b in make_buckets(rows.hint, rows.lo, rows.hi, step, align):
        # a forced template runs in every bucket, holding or not
        per_bucket += [(b, at(b.at))] if options.force_template else _decide_bucket(b, step, align, at)
    return _from_buckets(match, per_bucket)


def _decide_bucket(b: Bucket, step: int, align: int, at: Callable) -> list:
    """[(Bucket, Decision)] covering ``b`` (``at(m)``: the static decision at M = m): the decision
    at its representative where the decisions at its ends choose the same template and, where it
    rewrites, it is priced no slower than as written there; else each half of ``b`` decided so;
    where ``b`` cannot be cut, ``_held``'s choice over the three."""
    d = at(b.at)
    if b.hi is None:
        return [(b, d)]
    ends = sorted({m for m in (b.lo, b.hi // step * step) if m != b.at})
    priced = {m: at(m) for m in ends}
    if all(e.template == d.template and (not d.rewrites or _holds(d, e)) for e in priced.values()):
        return [(b, d)]
    halves = split(b, step, align)
    if halves is not None:
        return [pair for h in halves for pair in _decide_bucket(h, step, align, at)]
    return [_held(b, d, priced)]


def _priced_ms(d: Decision, other: Decision) -> float:
    """``d``'s template and configuration as priced in ``other`` (ms; inf where not priced)."""
    return next((c.predicted_ms for c in other.candidates if c.template == d.template and c.config == d.config
                 and c.predicted_ms is not None), math.inf)


def _holds(d: Decision, other: Decision) -> bool:
    """Whether ``d``'s template and configuration are priced no slower than the site as written in
    ``other`` (the same site's static decision at another M)."""
    return _priced_ms(d, other) <= _base_ms(other)


def _from_buckets(match: Match, per_bucket: list) -> BucketedDecision:
    """The BucketedDecision of (Bucket, static Decision at its representative M) pairs."""
    rows = match.rows
    priced, rows_out, table = [], [], []
    for b, d in per_bucket:
        base = d.candidates[0].predicted_ms if d.candidates else None
        chosen = next((c.predicted_ms for c in d.candidates if c.template == d.template and c.config == d.config), base)
        rows_out.append({"lo": b.lo, "hi": b.hi, "at": b.at, "template": d.template, "config": d.config,
                         "baseline_ms": base, "chosen_ms": chosen, "reason": d.reason,
                         "measured_gain": _timed_gain(d)})
        entry = {"max_m": b.hi, "template": d.template, "config": d.config}
        if table and (table[-1]["template"], table[-1]["config"]) == (d.template, d.config):
            table[-1]["max_m"] = b.hi
        else:
            table.append(entry)
        if b.lo <= rows.hint and (b.hi is None or rows.hint <= b.hi):
            priced = d.candidates
    rewrites = any(e["template"] != BASELINE for e in table)
    reason = (f"symbolic M = {rows.expr} (hint {rows.hint}, bounds [{rows.lo}, {rows.hi if rows.hi is not None else 'inf'}]): "
              + "; ".join(_bucket_text(r) for r in rows_out))
    if not rewrites:
        reason += "; no bucket gains: kept as written"
    return BucketedDecision(match, BUCKETED if rewrites else BASELINE, None, reason, [], buckets=rows_out,
                            table=table, priced=list(priced), per_bucket=per_bucket)


def second_look(decisions: list[Decision], graph: Any, options: Options, profile: Any,
                decide_one: Callable, pace: Callable, settle: Callable) -> list[Decision]:
    """``decisions`` with each symbolic site's buckets decided as a static graph's sites are after
    the per-site decision: per bucket of a site, the graph's sites static at that bucket's M (the
    site's symbolic neighbours of the same M expression at the same M, those of another expression
    at their M scaled by the hints' ratio, static sites as they are) go through ``pace``
    (host-launch pacing, given a graph) and this site's bucket through ``settle``. The bucket's
    ends are decided the same way, timed too where the model cannot call them (a representative
    timed alone can choose otherwise than a static compile at the bucket's top, where the
    measured gain differs), and the first look's rule holds: where they choose another template,
    or the choice rewrites and is slower than as written there, the bucket is cut and each half
    looked at again; a bucket that cannot be cut takes ``_held``'s choice over the three M."""
    idx = [i for i, d in enumerate(decisions) if isinstance(d, BucketedDecision) and d.per_bucket]
    if not idx or profile is None:
        return decisions
    out = list(decisions)
    first: dict = {}

    def static_at(j: int, m: int) -> Decision:  # site j's per-site decision at M = m, made once
        if (j, m) not in first:
            first[j, m] = decide_one(at_rows(decisions[j].match, m), options, profile, [])
        return first[j, m]

    def view_at(i: int, m: int) -> list[Decision]:
        """The graph's decisions with every symbolic site static at site i's M = m, paced."""
        view = list(decisions)
        hint = max(1, decisions[i].match.rows.hint)
        for j in idx:
            other = decisions[j].match
            view[j] = static_at(j, m if other.rows.expr == decisions[i].match.rows.expr
                                else _scaled(other, m * other.rows.hint / hint))
        return pace(graph, view, options, profile) if graph is not None else view

    for i in idx:
        d = decisions[i]
        step, align = unit_rows(d.match.rows, d.match.world_size), _align(d.match)
        for b, own in d.per_bucket:
            first[i, b.at] = own

        def settled(m: int, i: int = i) -> Decision:
            return settle([view_at(i, m)[i]], options, profile)[0]

        new = []
        for b, _ in d.per_bucket:  # a forced template runs in every bucket, holding or not
            new += [(b, settled(b.at))] if options.force_template else _decide_bucket(b, step, align, settled)
        out[i] = _from_buckets(d.match, new)
    return out


def _held(b: Bucket, chosen: Decision, ends: dict) -> tuple[Bucket, Decision]:
    """(bucket, decision) for ``chosen`` (the decision at ``b.at``) given the decisions at the
    bucket's ends: ``chosen`` where the ends choose as it does, or it rewrites and is priced no
    slower than as written there; else, of ``chosen``, the ends' choices and "as written", the one
    priced least summed over the representative and the ends (where settle timed a rewrite at one
    of them, chosen or not, its measured gain counts there), the bucket's ``at`` then the M it was
    chosen at."""
    same = all(e.template == chosen.template for e in ends.values())
    if (same and not chosen.rewrites) or (chosen.rewrites and all(_holds(chosen, e) for e in ends.values())):
        return b, chosen
    priced = {b.at: chosen, **ends}
    kept = chosen if not chosen.rewrites else dataclasses.replace(chosen, template=BASELINE, config=None)
    choices = [(b.at, chosen), *[(m, e) for m, e in ends.items() if e.rewrites], (b.at, kept)]

    def at_m(d: Decision, e: Decision) -> float:  # a rewrite settle timed at that M: its measured gain there
        gain = _timed_gain(d, e)
        return _base_ms(e) / gain if gain else _priced_ms(d, e)

    def total(d: Decision) -> float:
        return sum(at_m(d, e) for e in priced.values())

    m, pick = min(choices, key=lambda o: total(o[1]))
    if pick is chosen:
        return b, chosen
    text = ", ".join(f"{d.template} {total(d):.3f} ms" for _, d in choices)
    reason = (f"{chosen.template} chosen at M={b.at}; summed over M={', '.join(map(str, sorted(priced)))} "
              f"({text}): {pick.template} is priced least")
    return dataclasses.replace(b, at=m), dataclasses.replace(pick, reason=reason)


def _base_ms(d: Decision) -> float:
    """The site as written, as priced in ``d`` (ms; inf where not priced)."""
    return next((c.predicted_ms for c in d.candidates if c.template == BASELINE and c.predicted_ms is not None),
                math.inf)


def _scaled(match: Match, m: float) -> int:
    """A valid M of ``match`` (a multiple of its unit rows, within its bounds) nearest to ``m``."""
    step = unit_rows(match.rows, match.world_size)
    m = max(step, int(round(m / step)) * step, -(-match.rows.lo // step) * step)
    return m if match.rows.hi is None else min(m, match.rows.hi // step * step)


def _timed_gain(d: Decision, where: Decision | None = None) -> float | None:
    """The gain settle measured for ``d``'s choice at the M of ``where`` (by default d's own; None
    where it timed none of it there)."""
    m = (where or d).measured or {}
    timed = d.rewrites and (d.template, d.config) == (m.get("template"), m.get("config"))
    return m.get("measured_gain") if timed else None


def _bucket_text(r: dict) -> str:
    span = f"M<={r['hi']}" if r["hi"] is not None else f"M>={r['lo']}"
    if r["template"] == BASELINE:
        why = ""
        if r["baseline_ms"] is None or "force_template" in r["reason"] or "cannot" in r["reason"]:
            why = f" ({r['reason']})"
        return f"{span} as written{why}"
    if r.get("measured_gain"):  # what settle timed decides, so that is what the Report says
        return f"{span} {r['template']} {r['measured_gain']:.2f}x timed"
    gain = (f" {r['baseline_ms'] / r['chosen_ms']:.2f}x predicted" if r["baseline_ms"] and r["chosen_ms"] else "")
    return f"{span} {r['template']}{gain}"
