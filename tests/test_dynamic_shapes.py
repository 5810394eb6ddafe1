"""Sites whose row count is symbolic (dynamic shapes) are found, decided per M bucket and rewritten
into the bucketed op, which gives the site's result at any M over gloo.

* the bucket table and the choice at run time (no processes);
* graphs traced with only M symbolic, every kind and template forced, run at many M (odd, below
  W x tile, not multiples of W where the kind allows it) against the graph as written;
* torch.compile end to end (2 processes, gloo): mark_dynamic and automatic dynamic (two lengths,
  then a third without a recompile), forward and backward, plain functional collectives, their
  autograd forms and the DTensor TP+SP block; every graph's sites rewritten, results equal eager;
* a golden graph of one symbolic site; oc.plan of a model with a symbolic input.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_compile.predictor.buckets import Bucket, buckets, choose
from overlap_compile.testing.multiprocess import run_distributed

LENGTHS = (1, 2, 3, 7, 8, 17, 40)  # the symbolic length s; M is s or a multiple of it


def test_buckets_cover_every_valid_m_once():
    for hint, lo, hi, step in [(64, 8, None, 4), (20, 2, None, 1), (1000, 4, 4096, 2), (3, 2, 5, 1)]:
        bs = buckets(hint, lo, hi, step)
        assert bs[0].lo == -(-lo // step) * step and (bs[-1].hi is None) == (hi is None), bs
        for prev, nxt in zip(bs, bs[1:]):
            assert nxt.lo == prev.hi // step * step + step, bs
        for b in bs:
            assert b.at % step == 0 and b.lo <= b.at and (b.hi is None or b.at <= b.hi), b
        assert len(bs) <= 11


def test_choose_picks_the_bucket_of_m():
    table = [{"max_m": 256, "template": "baseline", "config": None},
             {"max_m": 4096, "template": "p2p_ring", "config": {}},
             {"max_m": None, "template": "signal_reorder", "config": {}}]
    assert [choose(table, m)["template"] for m in (1, 256, 257, 4096, 10 ** 6)] == [
        "baseline", "baseline", "p2p_ring", "p2p_ring", "signal_reorder"]
    assert Bucket(5, None, 7).label() == "M>4"


def _graph_cases(templates_: list[str]) -> list[dict]:
    """Run on every rank: each symbolic case x template, traced at s=5, run at LENGTHS."""
    from overlap_compile import config
    from overlap_compile.passes.pipeline import run_on_graph
    from overlap_compile.templates.bucketed import choices_made, clear_choices
    from tests import symbolic_cases as sc

    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    rows = []
    for name, case in sc.CASES.items():
        fn, shapes, dyn = case(group, world)
        example = [torch.randn(s) for s in shapes(5)]
        for template in templates_:
            gm = sc.trace(fn, example, dyn)
            with config.patch(force_template=template):
                record = run_on_graph(gm.graph, config.current())
            gm.recompile()
            site = record.sites[0]
            clear_choices()
            errs = []
            for s in LENGTHS:
                torch.manual_seed(100 * rank + s)
                inputs = [torch.randn(sh) for sh in shapes(s)]
                exp, got = fn(*inputs), gm(*inputs)
                exp, got = (exp if isinstance(exp, tuple) else (exp,)), (got if isinstance(got, tuple) else (got,))
                assert all(g.shape == e.shape for g, e in zip(got, exp)), (name, template, s)
                errs.append(max(((g - e).abs().max() / (e.abs().max() + 1e-6)).item() for g, e in zip(got, exp)))
            ran = {template for _, template, _ in choices_made()}
            rows.append({"case": name, "template": template, "kind": site.kind, "chosen": site.template,
                         "reason": site.reason, "err": max(errs), "ran": sorted(ran),
                         "in_graph": "bucketed" in record.after, "buckets": site.buckets})
    return rows


@pytest.mark.parametrize("templates_", [("p2p_ring", "signal_reorder"), ("priority_stream", "tile_fused")])
def test_every_kind_every_template_at_any_m(templates_):
    from overlap_compile import templates
    from tests import symbolic_cases as sc

    for rows in run_distributed(_graph_cases, world_size=2, args=(list(templates_),), timeout_s=600):
        for r in rows:
            label = f"{r['case']}/{r['template']}"
            assert r["kind"] == sc.KIND[r["case"]], label
            assert r["err"] < 1e-4, f"{label}: relative error {r['err']:.2e}"
            if r["kind"] in templates.get_spec(r["template"]).kinds:
                assert r["chosen"] == "bucketed" and r["in_graph"], f"{label}: {r['reason']}"
                assert r["template"] in r["ran"], f"{label}: ran {r['ran']}"
                assert r["buckets"] and all(b["template"] == r["template"] for b in r["buckets"]), label
            else:
                assert r["chosen"] == "baseline" and not r["in_graph"], label
