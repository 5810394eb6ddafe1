"""benchmarks/diagnostics/train_step_breakdown.py's idle-time arithmetic on CPU: device intervals
that overlap (a copy beside a GEMM) count once, gaps between them are idle."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    path = os.path.join(ROOT, "benchmarks", "diagnostics", "train_step_breakdown.py")
    spec = importlib.util.spec_from_file_location("train_step_breakdown", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_busy_counts_overlapping_intervals_once_and_the_gaps_are_idle():
    busy_and_span_ms = _module().busy_and_span_ms
    # us: [0, 1000) and a copy [500, 1500) beside it, nested [600, 700), a gap, then [2000, 2500)
    busy, span = busy_and_span_ms([(2000.0, 2500.0), (0.0, 1000.0), (600.0, 700.0), (500.0, 1500.0)])
    assert (busy, span) == pytest.approx((2.0, 2.5))  # idle 0.5 ms: [1500, 2000)
    assert busy_and_span_ms([(10.0, 20.0), (20.0, 30.0)]) == pytest.approx((0.02, 0.02))  # touching: no gap
    assert busy_and_span_ms([]) == (0.0, 0.0)
