"""Before/after graph texts for a few rewrites (EXPECTTEST_ACCEPT=1 regenerates them)."""
import expecttest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from overlap_compile import config
from overlap_compile.passes.pipeline import run_on_graph
from tests import graph_cases as gc


class GoldenGraphs(expecttest.TestCase):
    def setUp(self):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        self.group = dist.group.WORLD.group_name

    def tearDown(self):
        dist.destroy_process_group()

    def rewrite(self, case, template, **kw):
        fn, shapes = case(self.group, 2, **kw)
        gm = gc.trace(fn, [torch.randn(s) for s in shapes])
        with config.patch(force_template=template):
            record = run_on_graph(gm.graph, config.current())
        return record.after.strip().replace(f"'{self.group}'", "'G'")

    def test_signal_reorder_reducescatter_dtensor_dim1(self):
        self.assertExpectedInline(self.rewrite(gc.gemm_reducescatter_dim1, "signal_reorder", batch=2, seq=4), """\
def forward(self, a_1, b_1, c_1):
    signal_reorder_gemm_collective_default = torch.ops.overlap_compile.signal_reorder_gemm_collective.default(a_1, b_1, None, 'G', '{"chunk":2,"config":{"block_m":16,"block_n":16,"group_m":8,"programs":4,"wave_groups":[1]},"gathered":true,"has_bias":false,"k":12,"kind":"gemm_reducescatter","m":8,"n":20,"outer":2,"reduce_op":"sum","template":"signal_reorder","timeout_ms":10000,"world":2}');  a_1 = b_1 = None
    view_default = torch.ops.aten.view.default(signal_reorder_gemm_collective_default, [2, 1, 16, 16]);  signal_reorder_gemm_collective_default = None
    permute_default = torch.ops.aten.permute.default(view_default, [1, 2, 0, 3]);  view_default = None
    clone_default = torch.ops.aten.clone.default(permute_default, memory_format = torch.contiguous_format);  permute_default = None
    view_default_1 = torch.ops.aten.view.default(clone_default, [16, 32]);  clone_default = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default_1, 0, 0, 4);  view_default_1 = None
    slice_tensor_1 = torch.ops.aten.slice.Tensor(slice_tensor, 1, 0, 20);  slice_tensor = None
    view_default_2 = torch.ops.aten.view.default(slice_tensor_1, [2, 2, 20]);  slice_tensor_1 = None
    add = torch.ops.aten.add.Tensor(view_default_2, 1);  view_default_2 = None
    return add""")

    def test_signal_reorder_allreduce_full_and_partial_swizzle_groups(self):
        # 10 tile rows (one full group of 8 + 2), 2 tile cols with padding; the plan is the predictor's (cpu-gloo)
        self.assertExpectedInline(self.rewrite(gc.gemm_allreduce, "signal_reorder", m=150, n=20, k=8), """\
def forward(self, a_1, b_1, c_1):
    signal_reorder_gemm_collective_default = torch.ops.overlap_compile.signal_reorder_gemm_collective.default(a_1, b_1, None, 'G', '{"chunk":150,"config":{"block_m":16,"block_n":16,"group_m":8,"programs":8,"wave_groups":[1,2]},"gathered":true,"has_bias":false,"k":8,"kind":"gemm_allreduce","m":150,"n":20,"outer":1,"reduce_op":"sum","template":"signal_reorder","timeout_ms":10000,"world":2}');  a_1 = b_1 = None
    slice_tensor = torch.ops.aten.slice.Tensor(signal_reorder_gemm_collective_default, 0, 0, 16)
    view_default = torch.ops.aten.view.default(slice_tensor, [1, 2, 8, 16, 16]);  slice_tensor = None
    permute_default = torch.ops.aten.permute.default(view_default, [0, 2, 3, 1, 4]);  view_default = None
    clone_default = torch.ops.aten.clone.default(permute_default, memory_format = torch.contiguous_format);  permute_default = None
    view_default_1 = torch.ops.aten.view.default(clone_default, [128, 32]);  clone_default = None
    slice_tensor_1 = torch.ops.aten.slice.Tensor(signal_reorder_gemm_collective_default, 0, 16, 20);  signal_reorder_gemm_collective_default = None
    view_default_2 = torch.ops.aten.view.default(slice_tensor_1, [2, 2, 16, 16]);  slice_tensor_1 = None
    permute_default_1 = torch.ops.aten.permute.default(view_default_2, [1, 2, 0, 3]);  view_default_2 = None
    clone_default_1 = torch.ops.aten.clone.default(permute_default_1, memory_format = torch.contiguous_format);  permute_default_1 = None
    view_default_3 = torch.ops.aten.view.default(clone_default_1, [32, 32]);  clone_default_1 = None
    cat_default = torch.ops.aten.cat.default([view_default_1, view_default_3], 0);  view_default_1 = view_default_3 = None
    slice_tensor_2 = torch.ops.aten.slice.Tensor(cat_default, 0, 0, 150);  cat_default = None
    slice_tensor_3 = torch.ops.aten.slice.Tensor(slice_tensor_2, 1, 0, 20);  slice_tensor_2 = None
    view_default_4 = torch.ops.aten.view.default(slice_tensor_3, [2, 75, 20]);  slice_tensor_3 = None
    relu = torch.ops.aten.relu.default(view_default_4);  view_default_4 = None
    return relu""")
