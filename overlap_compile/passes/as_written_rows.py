"""The row counts at which a graph, once rewritten, does what torch.compile's own graph does.

Where every rewritten site of a graph is symbolic (its ops are bucketed, templates/bucketed.py)
and each table's first buckets say "as written", a call whose every site's M falls in those
buckets runs each site as written: through the bucketed op, whose dispatch and Python a
host-bound (decode-sized) call pays on top of torch.compile's. row_dispatch.py then sends such
calls to torch.compile's own compile of the graph instead.

    limits = as_written_limits(decisions, timeout_ms)
    # [(M's sympy expression, the largest M the table runs as written), ...] per rewritten site,
    # or None where some M is rewritten from its first row or a static site is rewritten
"""
from __future__ import annotations

from typing import Any

from ..templates.bucketed import BASELINE, BucketTable


def leading_as_written(table: BucketTable) -> int:
    """The largest M of the table's first run of "as written" buckets (0: none; the table's last
    bucket being as written too means no M rewrites, and the site would not be rewritten)."""
    limit = 0
    for entry in table.buckets:
        if entry["template"] != BASELINE or entry["max_m"] is None:
            break
        limit = entry["max_m"]
    return limit


def as_written_limits(decisions: list, timeout_ms: int) -> list[tuple[Any, int]] | None:
    """Per rewritten site, (M's expression, ``leading_as_written`` of its table); None where a
    rewritten site is static or rewrites from M = 1 (no call leaves the whole graph as written),
    or where nothing is rewritten (nothing to avoid)."""
    from .symbolic_rewrite import table_of

    out = []
    for d in decisions:
        if not d.rewrites:
            continue
        rows = getattr(d.match, "rows", None)
        if rows is None or rows.sym is None:
            return None
        limit = leading_as_written(table_of(d, timeout_ms))
        if limit < 1:
            return None
        out.append((rows.sym, limit))
    return out or None
