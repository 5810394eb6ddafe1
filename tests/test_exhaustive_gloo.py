"""search="exhaustive" for real over gloo (2 processes): the baseline and every candidate of a
GEMM + all-reduce site run on both ranks while Inductor compiles, the times are agreed, both
ranks decide the same. Several outstanding functional collectives on the compiling thread hung
both ranks (torch 2.13 CPU); the measurements now run on a fresh thread: this test hung before."""
import torch
import torch.distributed as dist

from overlap_compile.testing.multiprocess import run_distributed


def _measured_decision() -> list:
    import overlap_compile as oc
    from torch.distributed._functional_collectives import all_reduce

    group = dist.group.WORLD.group_name

    def f(a, b):
        return all_reduce(a @ b, "sum", group) + 1

    torch.manual_seed(dist.get_rank())
    report = oc.explain(f, torch.randn(64, 32), torch.randn(32, 48), search="exhaustive", min_speedup=1.0,
                        templates=("p2p_ring", "priority_stream"))
    (site,) = report.sites
    return [site.template, site.config, site.predicted_ms]


def test_exhaustive_search_over_gloo_completes_and_agrees():
    per_rank = run_distributed(_measured_decision, world_size=2, timeout_s=300)
    assert per_rank[0] == per_rank[1]  # the same measured numbers and the same choice on both ranks
    template, config, measured = per_rank[0]
    assert measured["baseline"] > 0 and len(measured) >= 4, measured
    assert all(v is not None and v > 0 for v in measured.values()), measured
    # a rewrite is taken only when it measured fastest (the margin may still keep the baseline)
    if template != "baseline":
        mine = min(v for k, v in measured.items() if k.startswith(template))
        assert mine == min(measured.values()) and mine < measured["baseline"], (template, measured)
