"""Ranks that disagree about a rewritten site (other shapes, one rank compiled without the backend,
one rank's op raising before it runs) get a clear error naming the site and the group, on every rank that reached it, within
signal_timeout_ms (or the allowance for ranks still compiling, ARRIVAL_TIMEOUT_S): the plans are compared through the store, never through a collective that a
missing rank could leave unpaired (CPU, gloo, the reference path)."""
from __future__ import annotations

import time

import pytest
import torch

from overlap_compile.testing.multiprocess import run_distributed


def disagree(case: str) -> dict:
    import torch.distributed as dist

    from overlap_compile import config, templates
    from overlap_compile.runtime import agreement
    from overlap_compile.runtime.agreement import DecisionMismatchError
    from overlap_compile.testing.patterns import site_plan

    templates.load_all_ops()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    m = 8 * world * (2 if case == "shapes" and rank == 1 else 1)  # rank 1 has other shapes
    plan = site_plan("gemm_reducescatter", "p2p_ring", m, 16, 8, world)
    a, b = torch.randn(m, 8), torch.randn(8, 16)
    if case == "raises" and rank == 1:  # inputs that do not fit the plan: its op raises before running
        a = torch.randn(m + 1, 8)
    # the bound is signal_timeout_ms alone (no rank here is still compiling), but for a late rank;
    # a peer that raised is reported at once, so that case keeps the long allowance (not waited out)
    agreement.ARRIVAL_TIMEOUT_S = {"late": 30.0, "raises": 300.0}.get(case, 0.0)
    start = time.monotonic()
    if case == "late" and rank == 1:  # still compiling when rank 0 reaches the site
        time.sleep(3.0)
    if case == "missing" and rank == 1:  # compiled without the backend: never reaches the op
        return {"rank": rank, "error": None, "s": 0.0}
    error, kind = None, None
    try:
        with config.patch(signal_timeout_ms=1500):
            torch.ops.overlap_compile.p2p_ring_gemm_collective(a, b, None, group, plan)
    except DecisionMismatchError as e:  # PeerFailedError included
        error, kind = str(e), type(e).__name__
    except ValueError as e:  # the rank whose inputs do not fit raises its own error
        error, kind = f"own: {e}", type(e).__name__
    return {"rank": rank, "error": error, "kind": kind, "s": time.monotonic() - start, "group": group}


@pytest.mark.parametrize("case", ["shapes", "missing"])
def test_disagreeing_ranks_get_a_clear_error(case):
    results = run_distributed(disagree, world_size=2, args=(case,), timeout_s=120)
    came = results if case == "shapes" else results[:1]
    for r in came:
        assert r["error"], r
        assert "p2p_ring gemm_reducescatter" in r["error"] and f"group {r['group']!r}" in r["error"], r["error"]
        assert r["s"] < 10, r
    if case == "shapes":  # each rank's site in words, so the difference shows
        assert "rank 0: p2p_ring gemm_reducescatter 16x16x8" in results[0]["error"], results[0]["error"]
        assert "rank 1: p2p_ring gemm_reducescatter 32x16x8" in results[0]["error"], results[0]["error"]
    else:
        assert "rank(s) [1] did not reach it within 1500 ms" in results[0]["error"]


def test_a_rank_whose_op_raises_is_reported_at_once_on_the_others():
    """Rank 1's op raises on inputs that do not fit its plan; rank 0, already waiting at the site's
    plan check, raises too within a few seconds (not ARRIVAL_TIMEOUT_S, 300 s here), naming the
    site, the group, rank 1 and its error."""
    r0, r1 = run_distributed(disagree, world_size=2, args=("raises",), timeout_s=120)
    assert r1["error"].startswith("own: p2p_ring: operands (17, 8)"), r1
    assert r0["kind"] == "PeerFailedError" and r0["s"] < 10, r0
    assert "site p2p_ring gemm_reducescatter 16x16x8" in r0["error"] and f"group {r0['group']!r}" in r0["error"]
    assert "rank 1 raised there" in r0["error"] and "ValueError: p2p_ring: operands (17, 8)" in r0["error"], r0


def test_a_rank_still_compiling_past_signal_timeout_is_waited_for():
    """Ranks finish compiling at different times: one 3 s late (signal_timeout_ms 1500) is no error."""
    results = run_distributed(disagree, world_size=2, args=("late",), timeout_s=120)
    assert [r["error"] for r in results] == [None, None], results
    assert results[0]["s"] >= 2.5, results
