"""passes/moe_scatter.py on demo.moe's layer compiled at W = 2 over gloo, with the rewrite
allowed on CPU tensors (it is CUDA-only by default: ``DEVICES``): the dispatch buffer's
index_put into zeros becomes moe_scatter_rows (in training also the backward's buffer, whose
zeros passes/recompute_zeros.py keeps out of the saved tensors), the report says so, and the
layer's output (and in training, every gradient) equals eager's, with routing that overflows the capacity (dropped
choices clamped onto kept slots: the slots with several writers). Left as written, with the
reason: under force_template="baseline" (no line), with deterministic algorithms on, and on CPU
by default."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from overlap_compile.testing.multiprocess import run_distributed

H, F_, E, K_TOP, TOKENS = 16, 24, 4, 2, 12


def _compiled_vs_eager(capacity_factor: float, train: bool, devices: tuple, **options) -> dict:
    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.demo.moe import ExpertParallelMoE
    from overlap_compile.compile_caches import no_compile_caches
    from overlap_compile.passes import moe_scatter
    from overlap_compile.report import Report

    torch.manual_seed(0)
    layer = ExpertParallelMoE(H, F_, E, K_TOP, capacity_factor, dist.group.WORLD.group_name, dist.get_world_size(),
                              dist.get_rank())
    x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1 + dist.get_rank()), requires_grad=train)
    report = Report()
    moe_scatter.DEVICES = devices
    torch._dynamo.reset()
    try:
        with no_compile_caches(), oc.config.patch(**options):
            fn = torch.compile(layer, backend=functools.partial(overlap_backend, report=report))
            got = fn(x)
            grads = torch.autograd.grad(got.square().mean(), [x, *layer.parameters()]) if train else []
    finally:
        moe_scatter.DEVICES = ("cuda",)
    want = layer(x)
    want_grads = torch.autograd.grad(want.square().mean(), [x, *layer.parameters()]) if train else []
    errs = [((g - w).norm() / w.norm().clamp_min(1e-30)).item() for g, w in zip([got, *grads], [want, *want_grads])]
    forward = [r for r in report.records if r.name.startswith("forward")]
    backward = [r for r in report.records if r.name.startswith("backward")]
    return {"errs": errs, "lines": [b for r in forward for b in r.moe_buffers],
            "after": "\n".join(r.after for r in forward),
            "backward_lines": [b for r in backward for b in r.moe_buffers],
            "backward_before": "\n".join(r.before for r in backward),
            "backward_after": "\n".join(r.after for r in backward)}


def _cases() -> dict:
    out = {}
    for name, cf, train in (("inference", 1.25, False), ("overflow", 0.5, False), ("training overflow", 0.5, True)):
        out[name] = _compiled_vs_eager(cf, train, ("cpu",))
    out["baseline"] = _compiled_vs_eager(0.5, False, ("cpu",), force_template="baseline")
    out["cuda only"] = _compiled_vs_eager(0.5, False, ("cuda",))
    torch.use_deterministic_algorithms(True)
    try:
        out["deterministic"] = _compiled_vs_eager(0.5, False, ("cpu",))
    finally:
        torch.use_deterministic_algorithms(False)
    return out


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    return run_distributed(_cases, world_size=2, timeout_s=600)[0]


def test_dispatch_buffer_is_filled_by_moe_scatter_rows_and_the_layer_is_unchanged():
    for name in ("inference", "overflow", "training overflow"):
        r = _results()[name]
        assert len(r["lines"]) == 1 and "filled by moe_scatter_rows" in r["lines"][0], (name, r["lines"])
        assert "moe_scatter_rows" in r["after"] and "index_put" not in r["after"], (name, r["after"])
        assert max(r["errs"]) < 1e-5, (name, r["errs"])


def test_training_backward_buffer_is_filled_by_moe_scatter_rows_too():
    """The backward's gradient of the combine's gather starts from zeros of its own (recomputed,
    passes/recompute_zeros.py, not a saved forward tensor), so its index_put is taken as well;
    every gradient equals eager's (checked in the test above)."""
    r = _results()["training overflow"]
    assert len(r["backward_lines"]) == 1 and "filled by moe_scatter_rows" in r["backward_lines"][0], r["backward_lines"]
    assert "aten.full.default" in r["backward_before"], "the backward's zeros were not recomputed in it"
    assert "moe_scatter_rows" in r["backward_after"] and "index_put" not in r["backward_after"], r["backward_after"]


def test_buffers_left_as_written_say_why():
    res = _results()
    assert res["baseline"]["lines"] == [] and "index_put" in res["baseline"]["after"]
    (line,) = res["cuda only"]["lines"]
    assert "left as written (on cpu (rewritten on cuda only))" in line, line
    (line,) = res["deterministic"]["lines"]
    assert "use_deterministic_algorithms is on" in line, line
    for name in ("baseline", "cuda only", "deterministic"):
        assert max(res[name]["errs"]) < 1e-5, (name, res[name]["errs"])
