"""The decision of a site whose row count M is symbolic: one choice per M bucket.

The buckets (predictor/buckets.py) come from M's size hint and the compile's bounds. For each,
the site is priced as a static site at the bucket's representative M (a whole number of GEMM
tiles per ring piece where the bucket holds one) by the same per-site decision as any static
site (decide._decide_one). ``second_look`` then gives each bucket what decide gives a static
graph after that: per bucket, every site of the graph is made static at its M there (sites of
another symbolic M scaled by the ratio of the hints) and passed through the host-launch pacing
and, for the symbolic sites, the measuring of uncertain sites, so a bucket chooses what a static
compile at its representative M would. Neighbouring buckets with the same choice are merged
into one table entry; the site is rewritten (template ``BUCKETED``: templates/bucketed.py's op)
when any bucket rewrites. ``priced`` holds the candidates of the bucket holding the size hint,
for the Report, and ``buckets`` one row per bucket.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ..config import Options
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


def _align(match: Match) -> int:
    """Rows the prices repeat over: a whole cuBLAS tile in each of the W pieces a template cuts
    (p2p_ring's chunks, the reduce-scatter's stripes) and in the whole GEMM."""
    from ..predictor.models import CUBLAS_TILE

    step = unit_rows(match.rows, match.world_size)
    tile = CUBLAS_TILE[0] * max(1, match.world_size)
    return step * tile // math.gcd(step, tile)


def decide_buckets(match: Match, options: Options, profile: Any, decide_one: Callable) -> Decision:
    rows = match.rows
    per_bucket = [(b, decide_one(at_rows(match, b.at), options, profile, []))
                  for b in make_buckets(rows.hint, rows.lo, rows.hi, unit_rows(rows, match.world_size), _align(match))]
    return _from_buckets(match, per_bucket)


def _from_buckets(match: Match, per_bucket: list) -> BucketedDecision:
    """The BucketedDecision of (Bucket, static Decision at its representative M) pairs."""
    rows = match.rows
    priced, rows_out, table = [], [], []
    for b, d in per_bucket:
        base = d.candidates[0].predicted_ms if d.candidates else None
        chosen = next((c.predicted_ms for c in d.candidates if c.template == d.template and c.config == d.config), base)
        rows_out.append({"lo": b.lo, "hi": b.hi, "at": b.at, "template": d.template, "config": d.config,
                         "baseline_ms": base, "chosen_ms": chosen, "reason": d.reason})
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
    site's other symbolic neighbours of the same M expression at the same bucket, those of another
    expression at their M scaled by the hints' ratio, static sites as they are) go through
    ``pace`` (host-launch pacing, given a graph) and this site's bucket through ``settle``."""
    idx = [i for i, d in enumerate(decisions) if isinstance(d, BucketedDecision) and d.per_bucket]
    if not idx or profile is None:
        return decisions
    out = list(decisions)
    done: set[int] = set()
    for i in idx:
        if i in done:
            continue
        d = decisions[i]
        # the sites of this M expression share its buckets: one static view per bucket serves all
        peers = [j for j in idx if j not in done and decisions[j].match.rows.expr == d.match.rows.expr
                 and [b for b, _ in decisions[j].per_bucket] == [b for b, _ in d.per_bucket]]
        new = {j: [] for j in peers}
        for k, (b, _) in enumerate(d.per_bucket):
            view = list(decisions)
            for j in idx:
                if j in new:
                    view[j] = decisions[j].per_bucket[k][1]
                else:
                    other = decisions[j].match
                    m = _scaled(other, b.at * other.rows.hint / max(1, d.match.rows.hint))
                    view[j] = decide_one(at_rows(other, m), options, profile, [])
            if graph is not None:
                view = pace(graph, view, options, profile)
            settled = settle([view[j] for j in peers], options, profile)
            for j, s in zip(peers, settled):
                new[j].append((b, s))
        for j in peers:
            out[j] = _from_buckets(decisions[j].match, new[j])
            done.add(j)
    return out


def _scaled(match: Match, m: float) -> int:
    """A valid M of ``match`` (a multiple of its unit rows, within its bounds) nearest to ``m``."""
    step = unit_rows(match.rows, match.world_size)
    m = max(step, int(round(m / step)) * step, -(-match.rows.lo // step) * step)
    return m if match.rows.hi is None else min(m, match.rows.hi // step * step)


def _bucket_text(r: dict) -> str:
    span = f"M<={r['hi']}" if r["hi"] is not None else f"M>={r['lo']}"
    if r["template"] == BASELINE:
        why = ""
        if r["baseline_ms"] is None or "force_template" in r["reason"] or "cannot" in r["reason"]:
            why = f" ({r['reason']})"
        return f"{span} as written{why}"
    gain = (f" {r['baseline_ms'] / r['chosen_ms']:.2f}x" if r["baseline_ms"] and r["chosen_ms"] else "")
    return f"{span} {r['template']}{gain}"
