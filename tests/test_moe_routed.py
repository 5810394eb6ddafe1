"""moe_fused's payload-only pipeline (templates/moe_fused/routed.py): the sizes it reads off the
dispatch buffer, the packed row maps, the grouped GEMMs on both of their paths, and the whole
pipeline over gloo at W = 3 against the capacity pipeline (reference.py) with ragged zero tails,
a peer that gets nothing, a full expert, NaN rows and the saved intermediates; only the routed
rows reach the experts."""
import pytest
import torch
import torch.distributed as dist

from overlap_compile.templates.moe_fused import routed
from overlap_compile.testing.multiprocess import run_distributed


def test_sizes_are_one_past_the_last_nonzero_row():
    x = torch.randn(2, 3, 6, 5)
    x[0, 0, 4:] = 0            # a zero tail: 4 rows count
    x[0, 1] = 0                # nothing routed: 0
    x[0, 2, 1] = 0             # a zero row below a non-zero one still counts (it travels, exactly)
    x[1, 0, 1:] = 0
    x[1, 0, 0] = 0
    x[1, 0, 3, 2] = float("nan")  # NaN must travel
    x[1, 1, 5:] = 0
    x[1, 1, 4, 4] = -1e-30     # one tiny entry keeps its row
    got = routed.routed_sizes(x)
    assert got.dtype == torch.int32
    assert got.tolist() == [[4, 0, 6], [4, 5, 6]]


@pytest.mark.parametrize("sizes", [[3, 0, 2], [0, 0, 0], [1], [0, 4, 0, 1]])
def test_packed_rows_lists_each_group_in_order(sizes):
    starts = [7 * g + 2 for g in range(len(sizes))]
    want = [s + j for s, n in zip(starts, sizes) for j in range(n)]
    got = routed.packed_rows(torch.tensor(sizes), torch.tensor(starts), sum(sizes))
    assert got.tolist() == want


@pytest.mark.parametrize("k,m,dtype", [(16, 8, torch.float32),   # aligned: torch._grouped_mm
                                       (10, 6, torch.float32),   # 40-byte rows: one mm per expert
                                       (16, 24, torch.bfloat16)])
def test_grouped_mm_equals_one_mm_per_expert(k, m, dtype):
    torch.manual_seed(0)
    sizes = [3, 0, 5, 1]
    x, w = torch.randn(sum(sizes), k).to(dtype), torch.randn(len(sizes), k, m).to(dtype)
    offsets = torch.cumsum(torch.tensor(sizes), 0, dtype=torch.int32)
    got = routed.grouped_mm(x, w, sizes, offsets)
    bounds = [0, *offsets.tolist()]
    want = torch.cat([x[lo:hi].float() @ w[e].float() for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
    assert routed._grouped_mm_runs(x, w) == (k * x.element_size() % 16 == 0 and m * x.element_size() % 16 == 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol)


def _routed_vs_capacity() -> list:
    from overlap_compile.templates.moe_fused import reference
    from overlap_compile.templates.plans import MoePlan

    w, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    e, c, h, f = 3, 5, 16, 24
    torch.manual_seed(0)
    ws = [torch.randn(e, h, f) / 4, torch.randn(e, h, f) / 4, torch.randn(e, f, h) / 5]
    torch.manual_seed(1 + rank)
    buf = torch.randn(w, e, c, h)
    fill = torch.randint(0, c + 1, (w, e))  # ragged tails of zeros
    fill[(rank + 1) % w] = 0                # one peer gets nothing from me
    fill[rank, 0] = c                       # a full expert
    for d in range(w):
        for j in range(e):
            buf[d, j, int(fill[d, j]):] = 0
    rows_seen = []
    swiglu = routed.grouped_swiglu

    def counting(x, sizes, *a):
        rows_seen.append(x.shape[0])
        return swiglu(x, sizes, *a)

    routed.grouped_swiglu = counting
    try:
        results = []
        for saves in ((), ("tokens", "gate", "up", "act")):
            config = {"split": "source"}
            want = reference.run(buf.view(-1, h), *ws, group, MoePlan("moe_fused", w, e, c, h, f, config, saves=saves))
            rows_seen.clear()
            got = routed.run(buf.view(-1, h), *ws, group,
                             MoePlan("moe_fused", w, e, c, h, f, {**config, "payload": "routed"}, saves=saves))
            want, got = (want, got) if saves else ([want], [got])
            results.append({"errs": [((g - x).abs().max() / x.abs().max().clamp_min(1e-12)).item()
                                     for g, x in zip(got, want)],
                            "rows": sum(rows_seen)})
        # what reaches my experts: every source's routed rows for them, nothing else
        arrivals = [torch.zeros(w, e, dtype=torch.long) for _ in range(w)]
        dist.all_gather(arrivals, fill)
        routed_to_me = sum(int(a[rank].sum()) for a in arrivals)
        return [results, routed_to_me, w * e * c]
    finally:
        routed.grouped_swiglu = swiglu


def test_routed_pipeline_equals_the_capacity_pipeline_and_skips_the_padding():
    for results, routed_to_me, slots in run_distributed(_routed_vs_capacity, world_size=3, timeout_s=120):
        for r in results:
            assert max(r["errs"]) < 1e-5, r
            assert r["rows"] == routed_to_me < slots, (r, routed_to_me, slots)


def _nan_row_travels() -> float:
    from overlap_compile.templates.moe_fused import reference
    from overlap_compile.templates.plans import MoePlan

    w, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    e, c, h, f = 2, 4, 16, 8
    torch.manual_seed(3)
    ws = [torch.randn(e, h, f), torch.randn(e, h, f), torch.randn(e, f, h)]
    buf = torch.zeros(w, e, c, h)
    buf[1 - rank, 1, 2, 3] = float("nan")  # the only routed row, for the peer's expert 1
    got = routed.run(buf.view(-1, h), *ws, group, MoePlan("moe_fused", w, e, c, h, f, {"split": "source",
                                                                                      "payload": "routed"}))
    want = reference.run(buf.view(-1, h), *ws, group, MoePlan("moe_fused", w, e, c, h, f, {"split": "source"}))
    same_nan = torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
    return float(same_nan and torch.equal(got.nan_to_num(), want.nan_to_num()))


def test_a_nan_row_travels_like_any_routed_row():
    assert run_distributed(_nan_row_travels, world_size=2, timeout_s=60) == [1.0, 1.0]


def test_routed_payload_configs_are_checked_and_dispatched():
    from overlap_compile.templates.moe_fused import op
    from overlap_compile.templates.moe_fused.spec import check_config
    from overlap_compile.templates.plans import MoePlan

    check_config({"split": "source", "payload": "routed"})
    check_config({"split": "source", "payload": "capacity", "transport": "p2p"})
    for bad in ({"split": "source", "payload": "all"}, {"split": "source", "payload": "routed", "transport": "p2p"},
                {"pieces": 2, "payload": "routed"}):
        with pytest.raises(ValueError, match="payload|config must be"):
            check_config(bad)
    plan = MoePlan("moe_fused", 2, 2, 4, 16, 8, {"split": "source", "payload": "routed"})
    assert op.path("g", torch.device("cpu"), plan) == "routed"
