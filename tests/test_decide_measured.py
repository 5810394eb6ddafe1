"""Decisions under the built-in H200 profile against what was measured on 4x H200
(benchmarks/results/ops-NVIDIA_H200-w4-*.json): wherever every measured rewrite of a shape was
slower than the sequential baseline, the decision must keep the baseline."""
import glob
import json
import os

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from overlap_compile import config, predictor
from overlap_compile.passes.decide import decide
from overlap_compile.testing.patterns import traced_site

RESULTS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "ops-NVIDIA_H200-w4-*.json")))


def _site(kind, m, n, k, world):
    return traced_site(kind, m, n, k, world)


@pytest.fixture
def fake4():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not RESULTS, reason="no H200x4 ops results committed")
@pytest.mark.parametrize("mode", ["eager", "cuda_graph"])
def test_baseline_kept_where_every_rewrite_measured_slower(fake4, mode):
    """Decisions for host-launched graphs against host-launched measurements, and for graphs
    Inductor captures (mode="reduce-overhead") against CUDA-graph measurements."""
    from torch._inductor import config as inductor_config
    rows = [r for path in RESULTS for r in json.load(open(path))]
    by_shape = {}
    for r in rows:
        if r["mode"] == mode and r["ms"] == r["ms"]:
            # the same method measured in several runs: keep its best (the decision must lose to none)
            d = by_shape.setdefault((r["kind"], tuple(r["shape"])), {})
            d[r["method"]] = min(r["ms"], d.get(r["method"], r["ms"]))
    checked = rewritten = 0
    profile = predictor.load_profile("h200")
    predictor.clear_cache()
    for (kind, shape), ms in sorted(by_shape.items()):
        with inductor_config.patch({"triton.cudagraphs": mode == "cuda_graph"}):
            (d,) = decide([_site(kind, *shape, 4)], config.current(), profile)
        rewrites = {k: v for k, v in ms.items() if k != "sequential"}
        if rewrites and min(rewrites.values()) >= ms["sequential"]:
            assert d.template == "baseline", f"{kind} {shape}: chose {d.template} ({d.reason}); measured {ms}"
            checked += 1
        elif d.template != "baseline":
            # a rewrite the predictor chooses must not measure slower than 0.98x of sequential
            assert d.template in ms, f"{kind} {shape}: chose {d.template}, which was never measured here"
            assert ms["sequential"] / ms[d.template] >= 0.98, f"{kind} {shape}: chose {d.template}; measured {ms}"
            rewritten += 1
    assert checked >= 5, (checked, rewritten)
    if mode == "cuda_graph":
        assert rewritten >= 1, "no measured win is taken under CUDA graphs"


def test_reference_only_templates_are_no_gpu_candidates(fake4):
    (d,) = decide([_site("gemm_reducescatter", 8192, 8192, 7168, 4)], config.current(), predictor.load_profile("h200"))
    notes = {c.template: c.note for c in d.candidates}
    assert "no GPU implementation" in notes["p2p_ring"]
    with config.patch(force_template="p2p_ring"):  # an explicit request still gets it
        (forced,) = decide([_site("gemm_reducescatter", 8192, 8192, 7168, 4)], config.current(), predictor.load_profile("h200"))
    assert forced.template == "p2p_ring"
