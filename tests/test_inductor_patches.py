"""The Inductor config a compile with the overlap pass runs under (inductor_hook.inductor_patches)."""
from overlap_compile import config
from overlap_compile.inductor_hook import inductor_patches, make_pass


def test_no_benchmark_decided_shape_padding_where_the_pass_runs():
    """Inductor's pad_mm pads a GEMM's operands where a timing on this rank says so: the graphs
    would then differ between ranks and runs, and with them the sites the pass finds."""
    with config.patch():
        assert inductor_patches(make_pass())["shape_padding"] is False
    with config.patch(enabled=False):
        assert "shape_padding" not in inductor_patches(make_pass())


def test_a_compile_given_a_report_fills_it_where_the_graph_is_cached(tmp_path, monkeypatch):
    """The second compile of the same graph hits Inductor's FX graph cache (and AOTAutograd's),
    which skip the post-grad passes: a compile given its own Report runs them anyway, forward and
    backward, so the Report asked for is never empty."""
    import functools

    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from overlap_compile import Report
    from overlap_compile.backend import overlap_backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def fn(x, w):
        return torch.relu(x @ w).sum(1)

    names = []
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            report = Report()
            compiled = torch.compile(fn, backend=functools.partial(overlap_backend, report=report))
            x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
            compiled(x, w).sum().backward()
            names.append([r.name for r in report.records])
    assert names[0] and len(names[1]) == len(names[0]) == 2, names
