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
