"""signal_reorder's subtile reduce-scatter form (FlashOverlap section 3.3.4): maps, where the finder
allows it, and the rewritten graph (RS -> row-wise ops -> all-gather, row fix after the gather)
equal to the original over gloo."""
import pytest
import torch
import torch.distributed as dist

from overlap_compile import config
from overlap_compile.passes.find import find
from overlap_compile.passes.pipeline import run_on_graph
from overlap_compile.testing.fake_group import fake_process_group
from overlap_compile.testing.multiprocess import run_distributed
from overlap_compile.tiling import TileGrid, subtile_fix, subtile_rows, tile_of, untile
from tests import graph_cases as gc


@pytest.mark.parametrize("world,rows,cols,bm,bn", [(2, 64, 20, 16, 8), (4, 96, 33, 8, 16), (4, 32, 7, 32, 4)])
def test_subtile_maps_round_trip(world, rows, cols, bm, bn):
    """Split every tile into W row subtiles, give subtile k to rank k, untile each rank's share,
    gather the ranks' rows in rank order, apply the fix: the original matrix comes back."""
    grid = TileGrid(rows, cols, bm, bn, 3)
    sub = subtile_rows(grid, world)
    x = torch.randn(rows, cols)
    tiles = torch.stack([tile_of(x, grid, t) for t in range(grid.num_tiles)]).view(grid.num_tiles, world, bm // world, bn)
    per_rank = [untile(tiles[:, k].contiguous(), sub) for k in range(world)]
    for k, part in enumerate(per_rank):  # rank k owns global rows tm*BM + k*BM/W + i
        want = x.view(rows // bm, world, bm // world, cols)[:, k].reshape(-1, cols)
        assert torch.equal(part, want)
    assert torch.equal(subtile_fix(torch.cat(per_rank), rows, cols, bm, world), x)


def test_subtile_rows_errors():
    with pytest.raises(ValueError, match="M % block_m == 0 and block_m % W == 0"):
        subtile_rows(TileGrid(60, 8, 16, 8), 2)


@pytest.fixture
def fake4():
    with fake_process_group(4) as name:
        yield name


def _match(group, world=4, **kw):
    fn, shapes = gc.gemm_reducescatter_rowwise_allgather(group, world, **kw)
    gm = gc.trace(fn, [torch.randn(s) for s in shapes])
    return gm, [m for m in find(gm.graph) if m.kind == "gemm_reducescatter"][0]


def test_finder_sees_the_rowwise_path(fake4):
    _, m = _match(fake4)
    assert m.subtile_ag_wait is not None and m.unsupported is None


@pytest.mark.parametrize("kw", [{"escape": True}, {"residual": True}, {"weight": True}])
def test_no_path_when_rows_escape_or_meet_another_tensor(fake4, kw):
    _, m = _match(fake4, **kw)
    assert m.subtile_ag_wait is None


def test_plan_uses_subtile_only_on_the_path(fake4):
    gm, _ = _match(fake4)
    with config.patch(force_template="signal_reorder"):
        record = run_on_graph(gm.graph, config.current())
    assert record.sites[0].config["rs_layout"] == "subtile"
    gm2, _ = _match(fake4, residual=True)
    with config.patch(force_template="signal_reorder"):
        record2 = run_on_graph(gm2.graph, config.current())
    assert "rs_layout" not in record2.sites[0].config


def check_subtile_numerics() -> list[float]:
    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    errs = []
    for m, n, k in [(32 * world, 32, 12), (64 * world, 21, 5)]:
        fn, shapes = gc.gemm_reducescatter_rowwise_allgather(group, world, m=m, n=n, k=k)
        torch.manual_seed(7 + rank)
        inputs = [torch.randn(s) for s in shapes]
        expected = fn(*inputs)
        gm = gc.trace(fn, inputs)
        with config.patch(force_template="signal_reorder"):
            record = run_on_graph(gm.graph, config.current())
        gm.recompile()
        assert record.sites[0].config.get("rs_layout") == "subtile", record.sites[0].config
        got = gm(*inputs)
        errs.append(((got - expected).abs().max() / expected.abs().max()).item())
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_subtile_rewrite_equals_original(world):
    for errs in run_distributed(check_subtile_numerics, world_size=world, timeout_s=300):
        assert max(errs) < 1e-5, errs
