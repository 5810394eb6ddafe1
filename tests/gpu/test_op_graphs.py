"""runtime.op_graphs on a GPU: host-launched op calls replayed from per-(site, buffers) CUDA graphs.

A toy two-stream op shows the mechanism (first sight runs as written, the second is captured,
then replays; inputs rewritten in place between calls; new addresses start over; a capture that
fails falls back with a warning; inside an outer capture the op is simply recorded). The real
ops at W=1 (one GPU, NCCL; patterns.site_op, since the pass keeps W=1 sites) run through torch.ops with their inputs changing every call, and
every call is compared with torch.mm + the collective.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _toy(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, side: torch.cuda.Stream) -> None:
    """A temporary made on the caller's stream, finished on another stream into ``out``."""
    caller = torch.cuda.current_stream()
    tmp = a @ b
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        out.copy_(tmp * 2)
    caller.wait_stream(side)  # tmp held until here, as the templates do (templates/base.py)


def _fresh():
    from overlap_compile.runtime import op_graphs

    op_graphs.clear()
    return op_graphs


def test_toy_op_is_captured_on_second_sight_and_replayed_right():
    op_graphs = _fresh()
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream(dev)
    a = torch.randn(256, 128, device=dev)
    b = torch.randn(128, 64, device=dev)
    wrong = 0
    for i in range(20):
        a.copy_(torch.randn_like(a))  # same address, new contents: a replay must read them
        out = torch.empty(256, 64, device=dev)
        op_graphs.run(("toy",), dev, (a, b), (out,), lambda: _toy(a, b, out, side))
        wrong += int(not torch.allclose(out, 2 * (a @ b), rtol=1e-4, atol=1e-4))
        del out  # the next call's output lands at the same address, as in a model's steady state
    assert wrong == 0
    assert (op_graphs.stats["eager"], op_graphs.stats["captured"], op_graphs.stats["replayed"]) == (1, 1, 18)

    a2 = a.clone()  # another address: a graph of a's address must not read it
    for i in range(3):
        out = torch.empty(256, 64, device=dev)
        op_graphs.run(("toy",), dev, (a2, b), (out,), lambda: _toy(a2, b, out, side))
        assert torch.allclose(out, 2 * (a2 @ b), rtol=1e-4, atol=1e-4)
        del out
    assert op_graphs.stats["eager"] == 2 and op_graphs.stats["captured"] == 2


def test_inside_an_outer_capture_the_op_is_recorded_as_written():
    op_graphs = _fresh()
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream(dev)
    a, b = torch.randn(64, 32, device=dev), torch.randn(32, 16, device=dev)
    out = torch.empty(64, 16, device=dev)
    _toy(a, b, out, side)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op_graphs.run(("toy-outer",), dev, (a, b), (out,), lambda: _toy(a, b, out, side))
    assert sum(op_graphs.stats.values()) == 0
    a.copy_(torch.randn_like(a))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, 2 * (a @ b), rtol=1e-4, atol=1e-4)


def test_a_capture_that_fails_runs_as_written_with_a_warning():
    op_graphs = _fresh()
    dev = torch.device("cuda", 0)
    a = torch.randn(64, 64, device=dev)

    def syncing(out):
        torch.cuda.synchronize()  # illegal while capturing
        out.copy_(a)

    for i in range(3):
        out = torch.empty(64, 64, device=dev)
        if i == 1:
            with pytest.warns(UserWarning, match="could not be captured"):
                op_graphs.run(("syncing-op", "plan"), dev, (a,), (out,), lambda: syncing(out))
        else:
            op_graphs.run(("syncing-op", "plan"), dev, (a,), (out,), lambda: syncing(out))
        assert torch.equal(out, a)
        del out  # the next call's output at the same address: the same key
    assert ("syncing-op", "plan") in op_graphs.failures()
    assert op_graphs.stats["replayed"] == 0 and op_graphs.stats["eager"] == 3
    torch.cuda.synchronize()  # the device is healthy after the aborted capture
    assert torch.equal(a + 0, a)
    # and so is the generator: a failed capture left it in capture mode, and the next random op
    # raised "Offset increment outside graph capture encountered unexpectedly"
    assert torch.randn(16, device=dev).isfinite().all()


# ---- the real ops, one GPU (W=1, NCCL) -----------------------------------------------------------

def real_ops_every_call(cases: list[tuple[str, str]], calls: int) -> list[dict]:
    import torch.distributed as dist

    from overlap_compile import templates
    from overlap_compile.runtime import op_graphs
    from overlap_compile.testing.patterns import collective, site_op

    templates.load_all_ops()
    dev = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(dev)
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    rows = []
    for kind, template in cases:
        op_graphs.clear()
        m, n, k = 1024, 768, 512
        a = torch.randn(m // world if kind == "allgather_gemm" else m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        op = site_op(kind, template, a, b, group, world)
        wrong = 0
        for i in range(calls):
            a.copy_(torch.randn_like(a))
            got = exp = None  # the last call's outputs freed first: steady-state addresses
            got = op()
            if kind == "allgather_gemm":
                gathered = collective(kind, a, group, world)
                exp = [gathered, gathered @ b]
            else:
                got, exp = [got], [collective(kind, a @ b, group, world)]
            for g, e in zip(got, exp):
                err = (g.float() - e.float()).norm() / e.float().norm()
                wrong += int(not bool(err < 2e-2))
        torch.cuda.synchronize()
        rows.append({"kind": kind, "template": template, "wrong": wrong, "stats": dict(op_graphs.stats)})
    return rows


@pytest.mark.parametrize("kind,template", [("gemm_allreduce", "priority_stream"),
                                           ("gemm_reducescatter", "priority_stream"),
                                           ("allgather_gemm", "priority_stream"),
                                           ("gemm_alltoall", "priority_stream")])
def test_real_op_replays_right_on_every_call(kind, template):
    from overlap_compile.testing.multiprocess import run_distributed

    (rows,) = run_distributed(real_ops_every_call, world_size=1, args=([(kind, template)], 30), backend="nccl",
                              timeout_s=300)
    (r,) = rows
    print(r)
    assert r["wrong"] == 0, r
    # the first calls may see the allocator settle on new addresses (each new key: one call as
    # written, one captured); after that every call is a replay
    assert r["stats"].get("captured", 0) <= 3 and not r["stats"].get("failed"), r["stats"]
    assert r["stats"].get("replayed", 0) >= 24, r["stats"]


def compiled_with_ops(calls: int) -> dict:
    """The real ops inside torch.compile'd functions (W=1): default mode (host-launched: the op
    replays from its graphs once Inductor's buffers repeat) and mode="reduce-overhead" (Inductor's
    CUDA-graph trees record the op as written). Every call compared with the sequential site."""
    import torch.distributed as dist

    from overlap_compile import templates
    from overlap_compile.runtime import op_graphs
    from overlap_compile.testing.patterns import collective, site_plan

    templates.load_all_ops()
    dev = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(dev)
    group = dist.group.WORLD.group_name
    a = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    b = torch.randn(512, 768, device=dev, dtype=torch.bfloat16)
    c = torch.randn(768, device=dev, dtype=torch.bfloat16)
    ar = site_plan("gemm_allreduce", "priority_stream", 1024, 768, 512, 1)
    ag = site_plan("allgather_gemm", "priority_stream", 1024, 768, 512, 1)
    ops = torch.ops.overlap_compile

    def fn(x, w, bias):
        y = ops.priority_stream_gemm_collective(x, w, None, group, ar)
        gathered, z = ops.priority_stream_allgather_gemm(x, [w], [None], group, ag)
        return torch.relu(y + bias) * 2, z.sum(dim=1) + gathered[:, 0]

    def expected():
        y = collective("gemm_allreduce", a @ b, group, 1)
        g = collective("allgather_gemm", a, group, 1)
        return torch.relu(y + c) * 2, (g @ b).sum(dim=1) + g[:, 0]

    out = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        op_graphs.clear()
        compiled = torch.compile(fn, mode=None if mode == "default" else mode)
        wrong = 0
        for _ in range(calls):
            a.copy_(torch.randn_like(a))
            got, exp = compiled(a, b, c), expected()
            for g, e in zip(got, exp):
                wrong += int(not torch.allclose(g.float(), e.float(), rtol=2e-2, atol=2e-1))
            got = exp = None
        torch.cuda.synchronize()
        out[mode] = {"wrong": wrong, "stats": dict(op_graphs.stats)}
    return out


def test_ops_in_compiled_graphs_default_and_reduce_overhead():
    from overlap_compile.testing.multiprocess import run_distributed

    (r,) = run_distributed(compiled_with_ops, world_size=1, args=(12,), backend="nccl", timeout_s=400)
    print(r)
    assert r["default"]["wrong"] == 0 and r["reduce-overhead"]["wrong"] == 0, r
    assert r["default"]["stats"].get("replayed", 0) >= 12, r  # two ops a call, most calls replayed
    assert not r["default"]["stats"].get("failed") and not r["reduce-overhead"]["stats"].get("failed"), r
    # under CUDA-graph trees the ops are recorded into Inductor's graph: nothing of ours is replayed
    assert r["reduce-overhead"]["stats"].get("replayed", 0) == 0, r


def test_a_capture_leaves_no_cublas_workspace_behind():
    """The side stream's GEMMs get their cuBLAS workspace inside the graphs' pool: after a call
    captured and replayed, the caching allocator holds no more than before (a workspace left
    outside the pool would be 32 MiB on Hopper, for the life of the process)."""
    op_graphs = _fresh()
    op_graphs._side.clear()  # a fresh side stream, as on a site's first capture
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream(dev)
    # no random numbers: this test reads the allocator, not the generator, whatever state the
    # file's earlier captures left the generator in
    a = torch.arange(512 * 256, device=dev, dtype=torch.float32).reshape(512, 256).sin()
    b = torch.arange(256 * 128, device=dev, dtype=torch.float32).reshape(256, 128).cos()
    torch.mm(a, b)  # the caller's own workspace exists before, as in a model
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    for _ in range(4):  # as written, captured, replayed twice
        out = torch.empty(512, 128, device=dev)
        op_graphs.run(("workspace",), dev, (a, b), (out,), lambda: _toy(a, b, out, side))
        torch.cuda.synchronize()
        assert torch.allclose(out, 2 * (a @ b), rtol=1e-4, atol=1e-4)
        del out
    assert op_graphs.stats["captured"] == 1 and op_graphs.stats["replayed"] == 2
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) - before < 2 ** 20
