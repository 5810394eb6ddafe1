"""passes/recompute_zeros.py: on a joint-like graph, only the zero fills an accumulating
index_put / index_add starts from are marked MUST_RECOMPUTE (so the partitioner makes them again
in the backward rather than saving them); a fill of another value, an index_put that overwrites
and other readers of zeros are left alone. inductor_hook registers it only where moe_scatter is on."""
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from overlap_compile import config
from overlap_compile.inductor_hook import RecomputeZerosPass, inductor_patches, make_pass
from overlap_compile.passes.recompute_zeros import mark_zeros_for_recompute

aten = torch.ops.aten


def _graph() -> tuple[fx.Graph, dict]:
    g = fx.Graph()
    idx, src = g.placeholder("idx"), g.placeholder("src")
    n = {}
    n["acc_put"] = g.call_function(aten.full.default, ([8, 4], 0))
    n["acc_add"] = g.call_function(aten.zeros.default, ([8, 4],))
    n["overwrite"] = g.call_function(aten.full.default, ([8, 4], 0))
    n["ones"] = g.call_function(aten.full.default, ([8, 4], 1))
    n["plain"] = g.call_function(aten.full.default, ([8, 4], 0))
    a = g.call_function(aten.index_put.default, (n["acc_put"], [idx], src, True))
    b = g.call_function(aten.index_add.default, (n["acc_add"], 0, idx, src))
    c = g.call_function(aten.index_put.default, (n["overwrite"], [idx], src, False))
    d = g.call_function(aten.index_put.default, (n["ones"], [idx], src, True))
    e = g.call_function(aten.add.Tensor, (n["plain"], src))
    g.output((a, b, c, d, e))
    return g, n


def test_only_accumulated_zero_fills_are_marked():
    g, n = _graph()
    assert mark_zeros_for_recompute(g) == 2
    marked = {k for k, node in n.items() if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert marked == {"acc_put", "acc_add"}


def test_registered_where_moe_scatter_fills_buffers():
    with config.patch(moe_scatter=True):
        on = inductor_patches(make_pass())
    assert isinstance(on.get("joint_custom_post_pass"), RecomputeZerosPass) and on["joint_custom_post_pass"].uuid()
    for off in ({"moe_scatter": False}, {"force_template": "baseline"}, {"enabled": False}):
        with config.patch(**off):
            assert "joint_custom_post_pass" not in inductor_patches(make_pass()), off


def test_a_joint_pass_the_user_had_runs_first_and_keys_the_cache():
    seen = []
    p = RecomputeZerosPass(chained=lambda graph: seen.append(len(graph.nodes)))
    g, n = _graph()
    p(g)
    assert seen and n["acc_put"].meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
    assert p.uuid() is None  # a plain callable has no key: Inductor then bypasses its cache
