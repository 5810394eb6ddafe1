"""The decision of a site whose row count M is symbolic: one choice per M bucket.

The buckets (predictor/buckets.py) come from M's size hint and the compile's bounds. For each,
the site is priced as a static site at the bucket's representative M by the same per-site
decision as any static site (decide._decide_one: every template and configuration, the baseline,
min_speedup, force_template), and the bucket takes that decision's template and configuration,
or "baseline". Neighbouring buckets with the same choice are merged into one table entry. The
site is rewritten (template ``BUCKETED``: the op of templates/bucketed.py, which picks the entry
of the run's M) when any bucket rewrites; otherwise it stays as written. The decision carries no
candidates of its own, so the host-launch pacing and the measuring of uncertain sites (static
sites only) pass it by; ``priced`` holds the candidates of the bucket holding the size hint,
for the Report's predicted column, and ``buckets`` one row per bucket.
"""
from __future__ import annotations

import dataclasses
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


def at_rows(match: Match, m: int) -> Match:
    """The symbolic site as a static one of M rows (what the predictor prices)."""
    rows = match.rows
    kw: dict[str, Any] = dict(m=m, rows=None, stripes=rows.stripes_at(m, match.world_size) or match.stripes)
    if isinstance(match, AllGatherGemmMatch):
        kw["gathered_shape"] = (m, match.k)
    else:
        kw["view_shape"] = (m, match.n)
    return dataclasses.replace(match, **kw)


def decide_buckets(match: Match, options: Options, profile: Any, decide_one: Callable) -> Decision:
    rows = match.rows
    rows_step = unit_rows(rows, match.world_size)
    priced, rows_out, table = [], [], []
    for b in make_buckets(rows.hint, rows.lo, rows.hi, rows_step):
        d = decide_one(at_rows(match, b.at), options, profile, [])
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
                            table=table, priced=list(priced))


def _bucket_text(r: dict) -> str:
    span = f"M<={r['hi']}" if r["hi"] is not None else f"M>={r['lo']}"
    if r["template"] == BASELINE:
        why = ""
        if r["baseline_ms"] is None or "force_template" in r["reason"] or "cannot" in r["reason"]:
            why = f" ({r['reason']})"
        return f"{span} as written{why}"
    gain = (f" {r['baseline_ms'] / r['chosen_ms']:.2f}x" if r["baseline_ms"] and r["chosen_ms"] else "")
    return f"{span} {r['template']}{gain}"
