"""Row-count buckets of a site whose M is symbolic: the size ranges a decision is made for.

A dynamic-shape compile knows M only as an expression with a size hint (the example's value) and
bounds (``mark_dynamic(min=, max=)``, else [2, unbounded)). The decision prices each template at
one representative M per bucket and the op picks the bucket's choice at run time. Buckets are
powers of two (M <= 2^i), from the smallest valid M up to the compile's upper bound, or where
there is none to max(8 x hint, 2^16); the last bucket is open. Representatives are the geometric
middle of a bucket's ends, a multiple of ``step`` (every valid M is one), moved to the nearest
multiple of ``align`` within a factor sqrt(2) of it, inside the bucket, where there is one. At
most ``MAX_BUCKETS``: a longer run of powers is thinned to every other one, then every fourth, ...
"""
from __future__ import annotations

import dataclasses
import math

MAX_BUCKETS = 10
OPEN_TOP_MIN = 1 << 16  # no upper bound known: buckets reach at least this far
OPEN_TOP_MAX = 1 << 22


@dataclasses.dataclass(frozen=True)
class Bucket:
    """M in [lo, hi] (hi None: no end); priced at ``at``."""

    lo: int
    hi: int | None
    at: int

    def label(self) -> str:
        return f"M>{self.lo - 1}" if self.hi is None else f"M<={self.hi}"


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step


def buckets(hint: int, lo: int, hi: int | None, step: int = 1, align: int = 1) -> list[Bucket]:
    """The buckets of a symbolic M: ``hint`` its example value, [lo, hi] its bounds, ``step`` the
    factor every valid M has, ``align`` the rows the predictor's prices repeat over (whole GEMM
    tiles in every piece a template cuts; a multiple of ``step``)."""
    step = max(1, step)
    align = max(step, align)
    first = _round_up(max(1, lo), step)
    top = hi if hi is not None else min(OPEN_TOP_MAX, max(OPEN_TOP_MIN, 8 * hint))
    top = max(top, first)
    powers = [1 << i for i in range(max(0, first.bit_length() - 1), top.bit_length() + 1)
              if first <= (1 << i) < top]
    stride = 1
    while len(powers) // stride + 1 > MAX_BUCKETS:
        stride *= 2
    bounds = powers[::stride] if stride > 1 else powers
    if hi is not None:
        bounds = bounds + [hi]
    out, start = [], first
    for b in bounds:
        end = b // step * step
        if end < start:
            continue
        out.append(Bucket(start, b, _aligned(_middle(start, end, step), start, end, align)))
        start = end + step
    if hi is None:
        out.append(Bucket(start, None, _aligned(_middle(start, 2 * start, step), start, 2 * start, align)))
    return out


MIN_SPLIT_RATIO = 1.5  # a bucket narrower than this (hi / lo) is not cut by a multiple of align


def split(bucket: Bucket, step: int = 1, align: int = 1) -> tuple[Bucket, Bucket] | None:
    """``bucket`` (closed) cut in two at the power of two nearest its geometric middle, strictly
    inside it, else (where it spans a factor MIN_SPLIT_RATIO) at the multiple of ``align`` nearest
    that middle; each half with its own representative. None where neither lies inside."""
    if bucket.hi is None:
        return None
    step, align = max(1, step), max(step, align)
    mid = math.sqrt(bucket.lo * bucket.hi)
    inside = [1 << i for i in range(bucket.hi.bit_length() + 1) if bucket.lo <= (1 << i) < bucket.hi]
    if not inside and bucket.hi >= MIN_SPLIT_RATIO * bucket.lo:
        inside = [x for x in (int(mid) // align * align, -(-int(mid) // align) * align) if bucket.lo <= x < bucket.hi]
    inside = [p for p in inside if bucket.lo <= p // step * step and p // step * step + step <= bucket.hi]
    if not inside:
        return None
    p = min(inside, key=lambda x: (abs(math.log(x / mid)), x))
    end = p // step * step
    lo_half = Bucket(bucket.lo, p, _aligned(_middle(bucket.lo, end, step), bucket.lo, end, align))
    top = bucket.hi // step * step
    hi_half = Bucket(end + step, bucket.hi, _aligned(_middle(end + step, top, step), end + step, top, align))
    return lo_half, hi_half


def _aligned(m: int, lo: int, hi: int, align: int) -> int:
    """The multiple of ``align`` in [lo, hi] nearest to ``m`` (the lower one on a tie) and within a
    factor sqrt(2) of it (the middle half of a factor-of-four bucket, so never near an edge), else
    ``m``. A bucket's bottom is one step past a power of two, so the geometric middle of a
    factor-of-four bucket is too: its GEMM starts a nearly empty row of tiles (and each of a
    ring's pieces one more), a partial wave that prices the rewrites as no other M of the bucket."""
    down, up = m // align * align, -(-m // align) * align
    fits = [x for x in (down, up) if lo <= x <= hi and 2 * x * x >= m * m and x * x <= 2 * m * m]
    return min(fits, key=lambda x: (abs(x - m), x)) if fits else m


def _middle(lo: int, hi: int, step: int) -> int:
    """The geometric middle of [lo, hi], a multiple of ``step`` within them."""
    mid = int(math.isqrt(lo * hi))
    return min(max(_round_up(mid, step), lo), max(lo, hi // step * step))


def choose(table: list[dict], m: int) -> dict:
    """The entry of a bucket table (dicts with "max_m", None for the open end) that holds M."""
    for entry in table:
        if entry["max_m"] is None or m <= entry["max_m"]:
            return entry
    return table[-1]
