"""Tile/stripe/wave maps: the layout contract shared by references, graph glue and kernels."""
import itertools

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_compile.tiling import RowStripes, TileGrid, WaveSchedule, even_wave_groups, tile_coords, tile_of, untile


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), bm=st.sampled_from([1, 4, 8, 16]),
       bn=st.sampled_from([2, 8, 16]), gm=st.integers(1, 5))
def test_untile_inverts_tiling(rows, cols, bm, bn, gm):
    grid = TileGrid(rows, cols, bm, bn, gm)
    x = torch.randn(rows, cols)
    buf = torch.stack([tile_of(x, grid, t) for t in range(grid.num_tiles)])
    assert torch.equal(untile(buf, grid), x)


@pytest.mark.parametrize("tiles_m,tiles_n,gm", [(7, 5, 3), (8, 3, 8), (1, 9, 4), (10, 1, 3)])
def test_tile_coords_is_a_bijection_with_grouped_order(tiles_m, tiles_n, gm):
    coords = [tile_coords(t, tiles_m, tiles_n, gm) for t in range(tiles_m * tiles_n)]
    assert sorted(coords) == sorted(itertools.product(range(tiles_m), range(tiles_n)))
    # grouped order: consecutive ids stay within a band of gm tile rows
    for t, (tm, tn) in enumerate(coords):
        assert tm // gm == t // (gm * tiles_n)


def test_tile_coords_symbolic_form_matches_ints():
    """The same formula evaluated on sympy symbols gives the closed form the kernels use."""
    t, tm_, tn_, gm_ = sympy.symbols("t tiles_m tiles_n group_m", integer=True, nonnegative=True)
    sym_m, sym_n = tile_coords(t, tm_, tn_, gm_, minimum=sympy.Min)
    for vals in [(0, 7, 5, 3), (17, 7, 5, 3), (34, 7, 5, 3), (11, 10, 1, 3)]:
        subs = dict(zip((t, tm_, tn_, gm_), vals))
        assert (int(sym_m.subs(subs)), int(sym_n.subs(subs))) == tile_coords(*vals)


def test_tile_coords_on_tensors():
    t = torch.arange(35)
    m, n = tile_coords(t, 7, 5, 3, minimum=lambda a, b: torch.clamp(a, max=b))
    assert [(int(a), int(b)) for a, b in zip(m, n)] == [tile_coords(i, 7, 5, 3) for i in range(35)]


@pytest.mark.parametrize("shape,dim,world", [((12, 5), 0, 4), ((2, 12, 3, 5), 1, 3), ((2, 3, 8, 5), 2, 2)])
def test_row_stripes_match_tensor_chunking(shape, dim, world):
    x = torch.randn(shape)
    s = RowStripes.from_view(shape, dim, world)
    flat = x.reshape(-1, shape[-1])
    for k, chunk in enumerate(x.chunk(world, dim)):
        assert torch.equal(s.stripe(flat, k), chunk.reshape(-1, shape[-1]))
        rows = s.global_row(k, torch.arange(s.stripe_rows))
        assert torch.equal(flat[rows], chunk.reshape(-1, shape[-1]))
    out = torch.empty_like(flat)
    for k in range(world):
        s.place(out, k, s.stripe(flat, k))
    assert torch.equal(out, flat)


def test_row_stripes_errors():
    with pytest.raises(ValueError, match="not divisible by world size 4"):
        RowStripes.from_view((6, 5), 0, 4)
    with pytest.raises(ValueError, match="need a row dimension"):
        RowStripes.from_view((6, 5), 1, 2)


@pytest.mark.parametrize("num_exec,programs,groups,stripes", [(24, 4, (2, 4), 2), (30, 6, (1, 2, 2), 3), (13, 5, (3,), 1), (16, 4, (1, 1, 1, 1), 4)])
def test_wave_schedule_send_slots(num_exec, programs, groups, stripes):
    ws = WaveSchedule(num_exec, programs, groups, stripes)
    slots = [ws.send_slot(e) for e in range(num_exec)]
    assert sorted(slots) == list(range(num_exec))
    for (a, b), (la, lb) in zip(ws.exec_ranges(), ws.local_ranges()):
        in_group = [e for e in range(num_exec) if a <= ws.send_slot(e) < b]
        assert sorted(in_group) == list(range(a, b))  # a group is contiguous in exec order and slots
        per = (b - a) // stripes
        for e in in_group:  # stripe k's tiles form the k-th equal chunk of the group's slice
            local, k = divmod(e, stripes)
            assert a + k * per <= ws.send_slot(e) < a + (k + 1) * per
            assert la <= local < lb


def test_wave_schedule_errors():
    with pytest.raises(ValueError, match="sum to the wave count 4"):
        WaveSchedule(16, 4, (1, 2), 1)
    with pytest.raises(ValueError, match="multiples of the stripe count"):
        WaveSchedule(16, 3, (6,), 2)


def test_even_wave_groups():
    assert even_wave_groups(10, 4) == (2, 2, 3, 3)
    assert even_wave_groups(3, 8) == (1, 1, 1)
    assert sum(even_wave_groups(17, 5)) == 17
