"""overlap_compile.plan: the pass's decisions for a model on the meta device over a fake process
group, no GPU and no memory; and benchmarks/plan.py, which plans the e2e Llama blocks at their real
sizes and forecasts how much of their collectives' time the pass hides."""
import os
import sys

import pytest
import torch

import overlap_compile as oc
from overlap_compile.testing.fake_group import fake_process_group

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class _TPMLP(torch.nn.Module):
    """Sequence-parallel MLP: all-gather -> two GEMMs -> reduce-scatter (plain functional collectives)."""

    def __init__(self, group: str, world: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.group, self.world = group, world
        self.w1 = torch.nn.Parameter(torch.empty(hidden, ffn // world))
        self.w2 = torch.nn.Parameter(torch.empty(ffn // world, hidden))

    def forward(self, x):
        from torch.distributed._functional_collectives import (all_gather_tensor_autograd,
                                                               reduce_scatter_tensor_autograd)

        full = all_gather_tensor_autograd(x, gather_dim=0, group=self.group)
        return reduce_scatter_tensor_autograd(torch.relu(full @ self.w1) @ self.w2, "sum", scatter_dim=0,
                                              group=self.group)


def test_plan_on_meta_finds_and_decides_both_graphs():
    with fake_process_group(4) as group:
        mlp = _TPMLP(group, 4, 4096, 16384).to("meta", torch.bfloat16)
        x = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
        report = oc.plan(mlp, x, backward=True, mode="reduce-overhead", profile="h200")
    graphs = {s.graph.split("_")[0] for s in report.sites}
    assert graphs == {"forward", "backward"}, report
    kinds = sorted(s.kind for s in report.sites if s.graph.startswith("forward"))
    assert kinds == ["allgather_gemm", "gemm_reducescatter"], report
    for s in report.sites:
        assert s.predicted_ms["baseline"] is not None and s.comm_ms > 0 and s.chosen_ms is not None, s
    assert any(s.rewritten for s in report.sites), report  # the h200 profile rewrites 8192-row sites at W=4


def test_plan_without_backward_and_its_errors():
    with fake_process_group(2) as group:
        mlp = _TPMLP(group, 2, 1024, 4096).to("meta", torch.bfloat16)
        x = torch.empty(1024, 1024, device="meta", dtype=torch.bfloat16)
        with torch.no_grad():
            report = oc.plan(mlp, x, profile="h200")
        assert sorted(s.kind for s in report.sites) == ["allgather_gemm", "gemm_reducescatter"], report
        with pytest.raises(ValueError, match="min_speedup"):
            oc.plan(mlp, x, min_speedup=-1)
        with torch.no_grad(), pytest.raises(ValueError, match="no tensor that requires grad"):
            oc.plan(mlp, x, backward=True, profile="h200")


def test_llama_8b_block_forecast():
    """The Llama-3-8B block at W=2 (seq 8192), reduce-overhead, h200: 4 sites each way; in the
    backward the three collectives with a weight gradient before them stay as written with it
    beside them, the first all-gather (nothing before it) is rewritten; the forecast lies between
    what the decisions hide and all of the collectives' time, and counts the compute beside the
    collectives left as written apart (``deferred_ms``), not as hidden. (defer_compute is off by
    default; then nothing is beside them: test_llama_8b_block_without_defer_compute.)"""
    from benchmarks.plan import e2e_sizes, plan_block

    report = plan_block(e2e_sizes("8b"), 2, "reduce-overhead", "h200", defer_compute=True)
    fwd = [s for s in report.sites if s.graph.startswith("forward")]
    bwd = [s for s in report.sites if s.graph.startswith("backward")]
    assert len(fwd) == 4 and len(bwd) == 4, report
    beside = [s for s in bwd if s.hidden_ms > 0]
    assert len(beside) == 3 and not any(s.rewritten for s in beside), report
    assert bwd[0].kind == "allgather_gemm" and bwd[0].hidden_ms == 0 and bwd[0].rewritten, report
    fc = report.forecast()["all"]
    assert 0.3 < fc["hidden_share"] <= fc["with_band_share"] <= 1.0, fc
    assert fc["deferred_ms"] == pytest.approx(sum(min(s.comm_ms, s.hidden_ms) for s in beside)), fc
    assert fc["hidden_share"] < fc["with_deferred_share"] <= 1.0, fc
    assert 0 < fc["standin_ms"] < 0.2 * fc["comm_ms"] and fc["gap_share"] > fc["hidden_share"], fc
    assert fc["sites"] == 8 and fc["rewritten"] >= 3, fc


def test_llama_8b_block_without_defer_compute():
    """By default (defer_compute off) nothing is moved under a collective: no site is priced with
    compute beside it, the forecast has no deferred credit, and the backward's data-gradient
    reduce-scatters are priced alone, so a rewrite predicted to hide them is taken."""
    from benchmarks.plan import e2e_sizes, plan_block

    report = plan_block(e2e_sizes("8b"), 2, "reduce-overhead", "h200")
    assert not any(r.deferred or r.prioritized for r in report.records), report
    assert all(s.hidden_ms == 0 for s in report.sites), report
    fc = report.forecast()["all"]
    assert fc["deferred_ms"] == 0 and fc["sites"] == 8, fc
    beside = plan_block(e2e_sizes("8b"), 2, "reduce-overhead", "h200", defer_compute=True)
    assert sum(s.rewritten for s in report.sites) > sum(s.rewritten for s in beside.sites), (report, beside)


def test_cpu_demo_plans_its_block_at_scale():
    """The CPU demo's last part: its own block planned at a given size as a GPU compile would
    decide it (here a small size, to keep the suite fast): every site of both graphs."""
    from overlap_compile.demo.run import plan_at_scale

    sizes = {"hidden": 1024, "intermediate": 4096, "heads": 8, "batch": 1, "seq": 2048}
    report = plan_at_scale(2, "h200", "reduce-overhead", sizes)
    assert len(report.sites) == 8 and {s.graph for s in report.sites} == {"forward", "backward"}, report
    assert report.forecast()["all"]["comm_ms"] > 0
