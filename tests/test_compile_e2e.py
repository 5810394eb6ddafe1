"""torch.compile end to end over gloo (2 processes): the backend, enable(), chaining, caching."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from overlap_compile.testing.multiprocess import run_distributed

pytestmark = pytest.mark.slow


def _block_check(template: str) -> dict:
    from overlap_compile.demo.run import CPU_SIZES, check_against_eager

    return check_against_eager(template, CPU_SIZES)


def test_overlap_backend_on_dtensor_tp_sp_block():
    """Forward + backward of a DTensor TP/SP Llama block: sites found in both graphs, rewritten,
    outputs and all gradients equal eager."""
    for r in run_distributed(_block_check, world_size=2, args=("signal_reorder",), timeout_s=600):
        assert r["out_err"] < 1e-4 and r["grad_err"] < 1e-4, r
        kinds = {(g.split("_")[0], k) for g, k, _, _ in r["sites"]}
        assert kinds == {("forward", "allgather_gemm"), ("forward", "gemm_reducescatter"),
                         ("backward", "allgather_gemm"), ("backward", "gemm_reducescatter")}
        rs = [t for g, k, t, _ in r["sites"] if k == "gemm_reducescatter"]
        assert rs and all(t == "signal_reorder" for t in rs)


class CountingPass:
    """A user's post-grad pass, installed before overlap_compile: it must still run."""

    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting-pass-v1"


def _megatron_mlp(x, w1, w2, group):
    c10d = torch.ops._c10d_functional
    h = torch.relu(x @ w1)
    return c10d.wait_tensor(c10d.all_reduce(h @ w2, "sum", group))


def _integration_checks() -> dict:
    import overlap_compile as oc
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    group = dist.group.WORLD.group_name
    torch.manual_seed(dist.get_rank())
    x, w1, w2 = torch.randn(48, 16), torch.randn(16, 32, requires_grad=True), torch.randn(32, 24)
    expected = _megatron_mlp(x, w1, w2, group)
    out = {}

    # enable() under the default backend; backward runs after the block has exited
    report = oc.Report()
    with oc.enable(report=report, force_template="signal_reorder"):
        y = torch.compile(_megatron_mlp)(x, w1, w2, group)
    y.sum().backward()
    out["enable_err"] = (y - expected).abs().max().item()
    out["enable_graphs"] = sorted(r.name for r in report.records)
    out["enable_rewritten"] = [s.template for s in report.sites]

    # a user's pass stays installed and runs for forward and backward. Compiled with the caches
    # off: both ranks share one cache directory, and a rank finding the other's compiled backward
    # there would (rightly) run no post-grad pass at all, so the count would depend on timing.
    torch._dynamo.reset()
    user = CountingPass()
    from torch._functorch import config as functorch_config

    with inductor_config.patch(post_grad_custom_post_pass=user, fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False), oc.config.patch(force_template="signal_reorder"):
        w1.grad = None
        y = torch.compile(_megatron_mlp, backend="overlap")(x, w1, w2, group)
        y.sum().backward()
    out["user_pass_calls"] = user.calls
    out["chained_err"] = (y - expected).abs().max().item()

    # second compile of the same graph hits the FX graph cache
    def hits():
        return counters["inductor"]["fxgraph_cache_hit"]

    with inductor_config.patch(fx_graph_cache=True), oc.config.patch(force_template="signal_reorder"):
        for _ in range(2):
            torch._dynamo.reset()
            before = hits()
            torch.compile(_megatron_mlp, backend="overlap")(x.detach(), w1.detach(), w2, group)
        out["cache_hits_second"] = hits() - before
    return out


def test_enable_chaining_and_cache(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for r in run_distributed(_integration_checks, world_size=2, env=env, timeout_s=600):
        assert r["enable_err"] < 1e-4 and r["chained_err"] < 1e-4, r
        assert r["enable_graphs"] == ["backward", "forward"], r
        assert "signal_reorder" in r["enable_rewritten"], r
        assert r["user_pass_calls"] == 2, r
        assert r["cache_hits_second"] >= 1, r


def test_import_initialises_neither_cuda_nor_process_group():
    code = ("import torch, torch.distributed as dist, overlap_compile as oc; "
            "assert not torch.cuda.is_initialized(); assert not dist.is_initialized(); "
            "assert hasattr(torch.ops.overlap_compile, 'signal_reorder_gemm_collective'); print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
