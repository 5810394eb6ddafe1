"""The finder on post-grad-like graphs (make_fx + functional collectives, fake process group)."""
import pytest
import torch
import torch.distributed as dist

from overlap_compile import config
from overlap_compile.passes.find import find
from overlap_compile.passes.pipeline import run_on_graph
from overlap_compile.testing.fake_group import fake_process_group
from tests import graph_cases as gc


@pytest.fixture
def fake_group(request):
    world = getattr(request, "param", 4)
    with fake_process_group(world) as name:
        yield name, world


def build(case, group, dtype=torch.float32, mode="fake", **kw):
    fn, shapes = case(*group, **kw)
    gm = gc.trace(fn, [torch.randn(s, dtype=dtype) for s in shapes], mode)
    return gm, find(gm.graph)


def test_gemm_allreduce(fake_group):
    gm, ms = build(gc.gemm_allreduce, fake_group)
    (m,) = ms
    assert m.kind == "gemm_allreduce" and m.unsupported is None
    assert (m.m, m.n, m.k, m.world_size, m.reduce_op) == (24, 20, 12, 4, "sum")
    assert m.mm_node.target == torch.ops.aten.mm.default and m.view_shape == (2, 12, 20)
    assert m.comm_bytes() == 24 * 20 * 4


@pytest.mark.parametrize("reader,fuses", [("relu", True), ("rmsnorm", True), ("mm", False), ("output", False)])
def test_output_fuses_says_whether_the_readers_read_a_permuted_result_in_place(fake_group, reader, fuses):
    """Pointwise / reduction readers (through views) fuse signal_reorder's un-reorder; a GEMM or
    the graph output needs it materialised. The predictor prices the two differently."""
    _, (m,) = build(gc.gemm_allreduce, fake_group, reader=reader)
    assert m.unsupported is None and m.output_fuses is fuses
    assert f"fuses={fuses}" in m.signature()


def test_gemm_allreduce_addmm_and_ops(fake_group):
    _, (m,) = build(gc.gemm_allreduce, fake_group, bias=True, op="max")
    assert m.bias_node is not None and m.reduce_op == "max" and m.unsupported is None


def test_gemm_reducescatter_dim0(fake_group):
    _, (m,) = build(gc.gemm_reducescatter_dim0, fake_group)
    assert m.kind == "gemm_reducescatter" and m.scatter_dim == 0 and m.unsupported is None
    assert (m.stripes.outer, m.stripes.world, m.stripes.chunk) == (1, 4, 6)


def test_gemm_reducescatter_dim1_dtensor_form(fake_group):
    _, (m,) = build(gc.gemm_reducescatter_dim1, fake_group)
    assert m.kind == "gemm_reducescatter" and m.scatter_dim == 1 and m.unsupported is None
    assert (m.stripes.outer, m.stripes.chunk) == (2, 3)
    assert {n.target for n in m.chain_nodes} >= {torch.ops.aten.split.Tensor, torch.ops.aten.cat.default}


def test_dim1_slice_forms_of_the_autograd_collectives(fake_group):
    """reduce_scatter_tensor_autograd / all_gather_tensor_autograd (Megatron-style models) cut the
    sequence with W slices where DTensor uses split: the same sites."""
    _, (rs,) = build(gc.gemm_reducescatter_dim1, fake_group, form="slice")
    assert rs.kind == "gemm_reducescatter" and rs.scatter_dim == 1 and rs.unsupported is None
    assert torch.ops.aten.slice.Tensor in {n.target for n in rs.chain_nodes}
    _, (ag,) = build(gc.allgather_gemm_dim1, fake_group, form="slice")
    assert ag.unsupported is None and ag.gather_dim == 1 and (ag.stripes.outer, ag.stripes.chunk) == (2, 3)


def test_sum_of_gemms_reducescatter(fake_group):
    _, (m,) = build(gc.gemm_sum_reducescatter, fake_group)
    assert m.unsupported is None and len(m.extra_terms) == 1 and m.k == 20


def test_allgather_gemm_dim0_two_consumers(fake_group):
    _, (m,) = build(gc.allgather_gemm_dim0, fake_group)
    assert m.kind == "allgather_gemm" and m.unsupported is None and m.gather_dim == 0
    assert [c.n for c in m.consumers] == [20, 7] and (m.m, m.k) == (20, 12)
    assert m.comm_bytes() == 5 * 12 * 4


def test_allgather_gemm_dim1_dtensor_form(fake_group):
    _, (m,) = build(gc.allgather_gemm_dim1, fake_group)
    assert m.unsupported is None and m.gather_dim == 1 and m.gathered_shape == (2, 12, 12)
    assert (m.stripes.outer, m.stripes.chunk) == (2, 3)


def test_allgather_gemm_batch1_view_chain(fake_group):
    _, (m,) = build(gc.allgather_gemm_batch1, fake_group)
    assert m.unsupported is None and m.gather_dim == 0 and (m.m, m.k) == (16, 12)
    assert len(m.chain_nodes) == 2  # both reshapes belong to the site


def test_allgather_gemm_one_flattening_view_per_gemm(fake_group):
    # an inference graph flattens the gathered [1, S, K] once per projection: one site, three GEMMs
    _, (m,) = build(gc.allgather_gemm_batch1_views, fake_group)
    assert m.unsupported is None and (m.m, m.k) == (16, 12)
    assert [c.n for c in m.consumers] == [20, 21, 22]
    assert len(m.gathered_twins) == 2 and len(m.chain_nodes) == 4


def test_alltoall_equal_and_unequal(fake_group):
    _, (m,) = build(gc.gemm_alltoall, fake_group)
    assert m.kind == "gemm_alltoall" and m.unsupported is None
    _, (u,) = build(gc.gemm_alltoall, fake_group, equal=False)
    assert "unequal split sizes" in u.unsupported


def test_gemm_used_elsewhere_is_left_with_reason(fake_group):
    _, (m,) = build(gc.gemm_used_twice, fake_group)
    assert "also used by" in m.unsupported


def test_collective_without_gemm_is_not_a_site(fake_group):
    _, ms = build(gc.allreduce_without_gemm, fake_group)
    assert ms == []


def test_unsupported_dtype(fake_group):
    _, (m,) = build(gc.gemm_allreduce, fake_group, dtype=torch.float64)
    assert "dtype torch.float64 not supported" in m.unsupported


@pytest.mark.parametrize("fake_group", [1], indirect=True)
def test_world_size_one(fake_group):
    _, (m,) = build(gc.gemm_reducescatter_dim0, fake_group)
    assert "world size 1" in m.unsupported


def test_symbolic_shapes_are_reported(fake_group):
    _, ms = build(gc.gemm_allreduce, fake_group, mode="symbolic")
    assert len(ms) == 1 and "symbolic shapes" in ms[0].unsupported


@pytest.mark.parametrize("case", sorted(gc.GEMM_COLLECTIVE_CASES))
def test_left_alone_means_unchanged(fake_group, case):
    gm, ms = build(gc.GEMM_COLLECTIVE_CASES[case], fake_group)
    before = gm.code
    with config.patch(force_template="baseline"):
        record = run_on_graph(gm.graph, config.current())
    assert len(record.sites) == len(ms) == 1
    assert record.sites[0].template == "baseline" and record.sites[0].reason
    gm.recompile()
    assert gm.code == before and record.before == record.after


def test_find_is_pure(fake_group):
    gm, _ = build(gc.gemm_reducescatter_dim1, fake_group)
    before = gm.code
    find(gm.graph)
    gm.recompile()
    assert gm.code == before
