"""moe_fused's persistent SwiGLU expert kernel on one GPU with every program resident at once
(what the interpreter cannot show: phase-2 tiles waiting on other programs' phase-1 tiles):
odd shapes, fp32 (TF32 off) and bf16, with and without arrival waits, 50 calls back to back on
new inputs (a race in the counters shows as a moving error), and a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]


def _case(w, e, c, h, f, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(w, e, c, h, device="cuda", generator=g).to(dtype)
    ws = [(torch.randn(e, h, f, device="cuda", generator=g) / h ** 0.5).to(dtype),
          (torch.randn(e, h, f, device="cuda", generator=g) / h ** 0.5).to(dtype),
          (torch.randn(e, f, h, device="cuda", generator=g) / f ** 0.5).to(dtype)]
    return x, ws


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("w,rank,e,c,h,f", [(2, 1, 4, 333, 512, 384), (4, 2, 2, 130, 256, 200)])
def test_matches_bmm_experts_over_repeated_calls(w, rank, e, c, h, f, dtype, tol, schedule):
    """Phase 2 reads act through TMA here (act is contiguous, rows 16-byte aligned): a read
    not ordered after its rows' act_done acquire shows as a moving error."""
    from overlap_compile.templates.moe_fused import expert_kernel as EK
    from overlap_compile.templates.moe_fused import reference

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = EK.ExpertTiles(64, 64, 128, 32, 4, 3, schedule=schedule)
    x0, ws0 = _case(w, e, c, h, f, dtype, 0)
    assert EK._tma_views(x0, *ws0, torch.empty(w, e, c, f, device="cuda", dtype=dtype), cfg, False)[4] is not None
    counters = EK.Counters.make(w, e, c, cfg.block_m, torch.device("cuda"))
    errs = []
    for call in range(50):
        x, ws = _case(w, e, c, h, f, dtype, call)
        waits = call % 2 == 1
        if waits:  # as the copy stream does when each (source, expert) chunk lands
            counters.arrival.view(torch.int32).fill_(1)
        y = EK.swiglu_experts(x, *ws, rank, cfg, counters=counters, arrived=not waits, timeout_ms=2000)
        want = torch.stack([reference.experts(x[s].float(), *(t.float() for t in ws)) for s in range(w)])
        errs.append(((y.float() - want).abs().max() / want.abs().max()).item())
    torch.cuda.synchronize()
    EK.check_errors(counters.err)
    assert max(errs) < tol, errs
    for name in ("arrival", "act_done", "y_done", "ticket"):
        assert int(getattr(counters, name).view(torch.int32).abs().sum()) == 0, name


def test_cuda_graph_replay():
    from overlap_compile.templates.moe_fused import expert_kernel as EK
    from overlap_compile.templates.moe_fused import reference

    cfg = EK.ExpertTiles(64, 64, 128, 32, 4, 3)
    x, ws = _case(2, 2, 200, 256, 320, torch.bfloat16, 7)
    counters = EK.Counters.make(2, 2, 200, cfg.block_m, torch.device("cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        EK.swiglu_experts(x, *ws, 0, cfg, counters=counters)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = EK.swiglu_experts(x, *ws, 0, cfg, counters=counters)
    for seed in (8, 9):
        fresh, _ = _case(2, 2, 200, 256, 320, torch.bfloat16, seed)
        x.copy_(fresh)
        graph.replay()
        want = torch.stack([reference.experts(x[s].float(), *(t.float() for t in ws)) for s in range(2)])
        assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2
    EK.check_errors(counters.err)


@pytest.mark.parametrize("tma_waits", [True, False])
def test_tokens_landing_while_the_kernel_runs(tma_waits):
    """The copy-engine path's order of events on one GPU: the kernel is already running when a
    copy stream lands each (source, expert) chunk and then writes its arrival flag
    (cuStreamWriteValue32, as kernels._fused_experts does). x starts as NaN, so a tile that
    read its tokens before they landed (a missing wait, or TMA reads not ordered after the
    acquire: tma_waits) leaves NaN in the result."""
    from overlap_compile.runtime import symm
    from overlap_compile.templates.moe_fused import expert_kernel as EK
    from overlap_compile.templates.moe_fused import reference

    w, e, c, h, f = 2, 2, 300, 512, 384
    cfg = EK.ExpertTiles(64, 64, 128, 32, 4, 3, tma_waits=tma_waits)
    counters = EK.Counters.make(w, e, c, cfg.block_m, torch.device("cuda"))
    copier = torch.cuda.Stream()
    for call in range(5):
        stage, ws = _case(w, e, c, h, f, torch.bfloat16, 100 + call)
        x = torch.full_like(stage, float("nan"))
        copier.wait_stream(torch.cuda.current_stream())  # x, stage and the counters exist
        # the copy stream's work is queued before the kernel, as in kernels._fused_experts (a
        # host call queued after a kernel that waits on it could block the host on first use)
        with torch.cuda.stream(copier):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the kernel is running and waiting by then
            for s in (1, 0):  # arrival order: own tokens first (rank 1), then the peer
                for j in range(e):
                    x[s, j].copy_(stage[s, j])
                    symm.write_value32(counters.arrival, s * e + j, 1)
        y = EK.swiglu_experts(x, *ws, 1, cfg, counters=counters, arrived=False, timeout_ms=5000)
        torch.cuda.current_stream().wait_stream(copier)
        torch.cuda.synchronize()
        EK.check_errors(counters.err)
        want = torch.stack([reference.experts(stage[s].float(), *(t.float() for t in ws)) for s in range(w)])
        assert not y.isnan().any(), f"call {call}: tiles read tokens before they landed"
        assert ((y.float() - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize("sized", [False, True])
def test_keeps_training_intermediates_in_the_saved_layout(sized):
    """x, act, gate and up in the saved expert-major layout ([E, W, C, *] seen as [W, E, C, *]),
    read and written through TMA: y and every kept value equal the bmm experts', zeros past the
    routed rows (``sized``), over 10 calls on new inputs."""
    from overlap_compile.templates.moe_fused import expert_kernel as EK
    from overlap_compile.templates.moe_fused import reference

    w, e, c, h, f = 2, 3, 333, 512, 384
    cfg = EK.ExpertTiles(64, 64, 128, 32, 4, 3)
    counters = EK.Counters.make(w, e, c, cfg.block_m, torch.device("cuda"))
    for call in range(10):
        x, ws = _case(w, e, c, h, f, torch.bfloat16, 200 + call)
        sizes = None
        if sized:
            sizes = torch.randint(0, c + 1, (w, e), dtype=torch.int32, generator=torch.Generator().manual_seed(call))
            sizes[0, 0], sizes[-1, -1] = 0, c
            for s in range(w):
                for j in range(e):
                    x[s, j, int(sizes[s, j]):] = 0
            sizes = sizes.cuda()
        tokens = torch.empty(e, w, c, h, device="cuda", dtype=torch.bfloat16)
        tokens.permute(1, 0, 2, 3).copy_(x)
        stores = {r: torch.full((e, w, c, f), float("nan"), device="cuda", dtype=torch.bfloat16)
                  for r in ("act", "gate", "up")}
        views = {r: t.permute(1, 0, 2, 3) for r, t in stores.items()}
        assert all(d is not None for d in EK._tma_views(tokens.permute(1, 0, 2, 3), *ws, views["act"], cfg, False))
        y = EK.swiglu_experts(tokens.permute(1, 0, 2, 3), *ws, 1, cfg, counters=counters, sizes=sizes, keep=views,
                              timeout_ms=2000)
        for s in range(w):
            kept = {r: torch.empty(e, c, f, device="cuda") for r in ("gate", "up", "act")}
            want = reference.experts(x[s].float(), *(t.float() for t in ws), keep=kept)
            assert ((y[s].float() - want).abs().max() / want.abs().max()).item() < 2e-2, (call, s, "y")
            for r in ("gate", "up", "act"):
                got = views[r][s].float()
                assert not bool(got.isnan().any()), (call, s, r)
                assert ((got - kept[r]).abs().max() / kept[r].abs().max()).item() < 2e-2, (call, s, r)
    torch.cuda.synchronize()
    EK.check_errors(counters.err)
