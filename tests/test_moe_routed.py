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


SIZES_UNDER_INTERPRETER = r"""
import torch
from overlap_compile.templates.moe_fused import routed_sizes as RS
torch.manual_seed(0)
for g, c, h in [(3, 37, 40), (5, 16, 300), (2, 1, 7), (4, 33, 256), (3, 300, 20)]:  # 300 rows: 3 chunks
    x = torch.randn(g, c, h)
    fills = torch.randint(0, c + 1, (g,))
    for i in range(g):
        x[i, int(fills[i]):] = 0
    if c > 3:
        x[0, 1] = 0                               # a zero row below a non-zero one
        x[g - 1] = 0
        x[g - 1, c // 2, h - 1] = float("nan")    # NaN alone in its group
    want, got = RS.sizes_torch(x), RS.sizes_kernel(x)
    assert torch.equal(want, got), (g, c, h, want.tolist(), got.tolist())
    assert want.tolist()[-1] == (c // 2 + 1 if c > 3 else want.tolist()[-1])
print("ok")
"""


def test_sizes_kernel_under_the_interpreter():
    """The top-down scan (routed_sizes._last_row_kernel) equals the torch ops on odd shapes: row
    blocks past the top, column blocks past H, one row, an all-zero group but a NaN."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SIZES_UNDER_INTERPRETER], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("sizes", [[3, 0, 2], [0, 0, 0], [1], [0, 4, 0, 1]])
def test_packed_rows_lists_each_group_in_order(sizes):
    starts = [7 * g + 2 for g in range(len(sizes))]
    want = [s + j for s, n in zip(starts, sizes) for j in range(n)]
    got = routed.packed_rows(torch.tensor(sizes), torch.tensor(starts), sum(sizes))
    assert got.tolist() == want


@pytest.mark.parametrize("h,f,dtype", [(16, 8, torch.float32),   # 16-byte rows: torch._grouped_mm can run
                                       (10, 6, torch.float32),   # 40-byte rows: one mm per expert only
                                       (16, 24, torch.bfloat16)])
@pytest.mark.parametrize("grouped_from", [1, 99])  # the grouped GEMM where it runs / one mm per expert
def test_swiglu_packed_equals_the_experts_on_every_slot(h, f, dtype, grouped_from, monkeypatch):
    monkeypatch.setattr(routed, "GROUPED_FROM_EXPERTS", grouped_from)
    torch.manual_seed(0)
    sizes = [3, 0, 5, 1]
    e = len(sizes)
    ws = [(torch.randn(e, h, f) / 3).to(dtype), (torch.randn(e, h, f) / 3).to(dtype), (torch.randn(e, f, h) / 3).to(dtype)]
    x = torch.randn(sum(sizes), h).to(dtype)
    offsets = torch.cumsum(torch.tensor(sizes), 0, dtype=torch.int32)
    y, inter = routed.swiglu_packed(x, sizes, offsets, *ws)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    lo = 0
    for j, n in enumerate(sizes):
        xe = x[lo:lo + n].float()
        gate, up = xe @ ws[0][j].float(), xe @ ws[1][j].float()
        act = torch.nn.functional.silu(gate) * up
        want = {"tokens": xe, "gate": gate, "up": up, "act": act}
        assert torch.allclose(y[lo:lo + n].float(), act @ ws[2][j].float(), rtol=tol, atol=tol), j
        for role in routed_roles():
            assert torch.allclose(inter[role][lo:lo + n].float(), want[role], rtol=tol, atol=tol), (j, role)
        lo += n


def routed_roles():
    from overlap_compile.templates.plans import MOE_SAVE_ROLES

    return MOE_SAVE_ROLES


def _routed_vs_capacity(grouped_from: int, trimmed_from: float) -> list:
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
    routed.GROUPED_FROM_EXPERTS, routed.TRIMMED_FROM_FILL = grouped_from, trimmed_from
    rows_seen = []
    swiglu = routed.swiglu_packed

    def counting(x, rows, *a):
        rows_seen.append(sum(rows))
        assert x.shape[0] == sum(rows)
        return swiglu(x, rows, *a)

    routed.swiglu_packed = counting
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
        routed.swiglu_packed = swiglu


def _routed_vs_capacity_every_way() -> list:
    # every piece packed (torch._grouped_mm / one mm per expert, routed rows only), every piece
    # trimmed (bmm over [E, m, H]), and as shipped (each piece by its fill): one process group
    return [(grouped_from, trimmed_from, _routed_vs_capacity(grouped_from, trimmed_from))
            for grouped_from, trimmed_from in ((1, 2.0), (99, 2.0), (1, 0.0), (1, 0.8))]


def test_routed_pipeline_equals_the_capacity_pipeline_and_skips_the_padding():
    for per_way in run_distributed(_routed_vs_capacity_every_way, world_size=3, timeout_s=180):
        for grouped_from, trimmed_from, (results, routed_to_me, slots) in per_way:
            for r in results:
                assert max(r["errs"]) < 1e-5, (grouped_from, trimmed_from, r)
                if trimmed_from > 1:  # packed pieces: exactly the routed rows reach the experts
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


def _routed_backward_vs_capacity(trimmed_from: float) -> list:
    from overlap_compile.templates.moe_fused import backward_reference as bref
    from overlap_compile.templates.plans import MoePlan

    w, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    routed.TRIMMED_FROM_FILL = trimmed_from
    e, c, h, f = 3, 5, 16, 24
    torch.manual_seed(0)
    wts = [torch.randn(e, f, h) / 4, torch.randn(e, f, h) / 4, torch.randn(e, h, f) / 5]  # w1t, w3t, w2t
    torch.manual_seed(1 + rank)
    saved = [torch.randn(e, h, w * c), torch.randn(e, w * c, f), torch.randn(e, w * c, f), torch.randn(e, f, w * c)]
    grad = torch.randn(w, e, c, h)
    fill = torch.randint(0, c + 1, (w, e))
    fill[(rank + 1) % w] = 0  # no gradient for one peer's experts
    fill[rank, 0] = c
    for d in range(w):
        for j in range(e):
            grad[d, j, int(fill[d, j]):] = 0
    plan = MoePlan("moe_fused", w, e, c, h, f, {"split": "source"}, direction="backward")
    want = bref.run(grad.view(-1, h), *saved, *wts, group, plan)
    got = bref.run_routed(grad.view(-1, h), *saved, *wts, group,
                          MoePlan("moe_fused", w, e, c, h, f, {"split": "source", "payload": "routed"},
                                  direction="backward"))
    return [((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(got, want)]


def _routed_backward_every_way() -> list:
    return [(t, _routed_backward_vs_capacity(t)) for t in (0.0, 2.0, 0.8)]  # trimmed / packed / by fill


def test_routed_backward_equals_the_capacity_backward():
    """moe_fused_backward's routed rounds: d_buf and the three weight gradients equal the capacity
    pipeline's with ragged zero gradient tails, a peer that gets no gradient and a full expert,
    every piece trimmed, every piece packed, and each by its fill."""
    for per_way in run_distributed(_routed_backward_every_way, world_size=3, timeout_s=180):
        for trimmed_from, errs in per_way:
            assert len(errs) == 4 and max(errs) < 1e-5, (trimmed_from, errs)
