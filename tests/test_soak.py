"""benchmarks/soak.py's dry run (CPU, gloo, the reference implementations): random sites for a few
seconds, one row per (template, kind, dtype, mode) in DESIGN.md's schema, every call right."""
from __future__ import annotations

import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_dry_run_rows(tmp_path):
    from benchmarks import soak

    rows = soak.main(["--dry-run", "--minutes", "0.02", "--calls", "3", "--out", str(tmp_path)])
    (path,) = list(tmp_path.iterdir())
    assert json.loads(path.read_text()) == rows
    assert rows and sum(r["calls"] for r in rows) > 0
    # each case in turn: the first rounds visit distinct (template, kind, dtype) cases
    assert len(rows) == len({(r["template"], r["kind"], r["dtype"]) for r in rows}) >= 2
    for r in rows:
        assert r["benchmark"] == "soak" and r["world_size"] == 2 and r["minutes"] == 0.02 and r["mode"] == "eager"
        assert r["wrong"] == r["timeouts"] == r["hangs"] == r["errors"] == 0, r
        for key in ("template", "kind", "dtype", "calls", "recompiles", "peak_mem_gib", "device"):
            assert key in r


def test_drawn_sites_fit_their_collective():
    """M odd where the collective allows it; dim 0 splits in W where it must; K and N multiples of 8."""
    from benchmarks.soak import draw_site

    rng = random.Random(1)
    for world in (2, 4):
        for _ in range(200):
            s = draw_site(rng, world, small_dims=rng.random() < 0.5)
            assert s["n"] % 8 == 0 and s["k"] % 8 == 0 and s["m"] > 0
            if s["kind"] == "gemm_allreduce":
                assert s["m"] % 2 == 1 or (s["m"] % world == 0 and (s["m"] // world) % 2 == 1)
            else:
                assert s["m"] % world == 0 and (s["m"] // world) % 2 == 1


def test_run_site_counts_wrong_and_nan_calls(tmp_path):
    """A call whose output is off (or NaN) on some input sets is counted wrong, each time it runs."""
    import torch
    import torch.distributed as dist

    from benchmarks.soak import run_site

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sets = [(torch.randn(5, 3), torch.randn(3, 4)) for _ in range(4)]
        eager = lambda a, b: a @ b  # noqa: E731
        calls, wrong, worst = run_site(eager, eager, sets, 1e-2, 0.0, 16, 16, torch.device("cpu"), lambda: None)
        assert (calls, wrong) == (16, 0) and worst < 1e-6
        off = lambda a, b: (a @ b) * (1.5 if a is sets[1][0] else 1.0)  # noqa: E731
        calls, wrong, worst = run_site(off, eager, sets, 1e-2, 0.0, 16, 16, torch.device("cpu"), lambda: None)
        assert (calls, wrong) == (16, 4) and 0.4 < worst < 0.6
        nan = lambda a, b: (a @ b) * (float("nan") if a is sets[2][0] else 1.0)  # noqa: E731
        calls, wrong, worst = run_site(nan, eager, sets, 1e-2, 0.0, 8, 8, torch.device("cpu"), lambda: None)
        assert (calls, wrong) == (8, 2) and worst == float("inf")
    finally:
        dist.destroy_process_group()


def test_cases_give_templates_turns_and_drop_kinds_not_offered():
    """Templates round-robin; every (kind, dtype, mode) of a template once per pass; a kind a
    forced template never takes leaves its turn after Cases.GIVE_UP sites, "auto" keeps all."""
    from benchmarks.soak import DTYPES, Cases, templates_for

    c = Cases(random.Random(0), ("eager", "cuda_graph"))
    names = list(c.todo)
    assert "auto" in names and len(names) >= 3
    first = [c.next() for _ in range(len(names))]
    assert [t for t, *_ in first] == names
    t = names[1]
    n = len(c.todo[t])
    assert n == 2 * len(DTYPES) * sum(t in templates_for(k) for k in ("gemm_allreduce", "gemm_reducescatter",
                                                                       "allgather_gemm", "gemm_alltoall"))
    seen = [first[1][1:]] + [c.next()[1:] for _ in range(len(names) * (n - 1))][1::len(names)]
    assert sorted(seen) == sorted(c.todo[t])  # one pass: each case once
    kind = c.todo[t][0][0]
    for _ in range(Cases.GIVE_UP):
        c.took(t, kind, False)
    assert all(k != kind for k, _, _ in c.todo[t]) and all(k != kind for k, _, _ in c.turn[t])
    for _ in range(Cases.GIVE_UP):
        c.took("auto", kind, False)
    assert any(k == kind for k, _, _ in c.todo["auto"])


def test_summary_sums_per_device_and_template(tmp_path):
    from benchmarks.soak import summary

    def row(device, template, kind, calls, wrong=0):
        return {"device": device, "template": template, "kind": kind, "dtype": "bfloat16", "mode": "eager",
                "calls": calls, "wrong": wrong, "timeouts": 0, "hangs": 0, "errors": 0}

    (tmp_path / "a.json").write_text(json.dumps([row("G", "p2p_ring", "allgather_gemm", 700),
                                                 row("G", "auto", "gemm_allreduce", 5, wrong=1)]))
    (tmp_path / "b.json").write_text(json.dumps([row("G", "p2p_ring", "allgather_gemm", 600),
                                                 row("G", "p2p_ring", "gemm_alltoall", 2000),
                                                 row("H", "p2p_ring", "gemm_alltoall", 0)]))
    got = summary([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert got["G"]["p2p_ring"] == {"calls": 3300, "failures": 0, "cases_run": 2, "fewest_calls_of_a_case": 1300}
    assert got["G"]["auto"]["failures"] == 1
    assert got["H"]["p2p_ring"] == {"calls": 0, "failures": 0, "cases_run": 0, "fewest_calls_of_a_case": 0}
