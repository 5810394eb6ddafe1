"""Tile and stripe maps shared by the reference implementations, the graph glue and the kernels.

* ``RowStripes``: how a GEMM output's rows split among the W ranks of a collective along dim ``d``
  of ``[D0, ..., D(n-1), N]``. With ``outer = D0*...*D(d-1)`` and
  ``chunk = (Dd / W) * D(d+1)*...*D(n-1)``, local row ``r`` of stripe ``k`` is global row
  ``(r // chunk) * W * chunk + k * chunk + r % chunk``; stripe ``k`` of a row-major matrix is
  the strided view ``x.view(outer, W, chunk, cols)[:, k]``.
* ``TileGrid``: ``block_m x block_n`` tiles (edges padded) in the grouped order a persistent GEMM
  walks (``group_m`` tile rows at a time, column-major inside); ``tile_coords`` uses only ``//``,
  ``%``, ``*``, ``+``, ``minimum``, so it runs on ints, tensors, sympy and in Triton.
* ``untile``: a tile buffer ``[T, BM, BN]`` back to ``[rows, cols]`` as views/permutes/cat/slice
  (fused by Inductor), written against ``emit(op, *args)``: ``call_op`` eagerly, FX nodes in a rewrite.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

aten = torch.ops.aten
Emit = Callable[..., Any]


def call_op(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The eager emitter: just run the op."""
    return op(*args, **kwargs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class RowStripes:
    """Rows of a matrix split among ``world`` ranks as ``outer`` blocks of ``world * chunk`` rows."""

    outer: int
    world: int
    chunk: int

    @property
    def rows(self) -> int:
        return self.outer * self.world * self.chunk

    @property
    def stripe_rows(self) -> int:
        return self.outer * self.chunk

    def global_row(self, k: Any, r: Any) -> Any:
        return (r // self.chunk) * (self.world * self.chunk) + k * self.chunk + r % self.chunk

    def stripe(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Rows of stripe ``k`` of a row-major matrix ``x`` (a view when ``outer == 1``)."""
        cols = x.shape[-1]
        s = x.reshape(self.outer, self.world, self.chunk, cols)[:, k]
        return s.reshape(self.stripe_rows, cols)

    def place(self, out: torch.Tensor, k: int, rows: torch.Tensor) -> None:
        """Write ``rows`` (stripe ``k``, ``[outer*chunk, cols]``) into the full matrix ``out``."""
        cols = out.shape[-1]
        out.view(self.outer, self.world, self.chunk, cols)[:, k].copy_(rows.view(self.outer, self.chunk, cols))

    @staticmethod
    def from_view(shape: tuple[int, ...], dim: int, world: int) -> "RowStripes":
        """Stripes for a collective along ``dim`` of a tensor of ``shape`` (last dim = columns)."""
        if not 0 <= dim < len(shape) - 1:
            raise ValueError(f"row stripes need a row dimension, got dim={dim} of shape {shape}")
        if shape[dim] % world:
            raise ValueError(f"dim {dim} of shape {shape} is not divisible by world size {world}")
        outer = 1
        for s in shape[:dim]:
            outer *= s
        inner = 1
        for s in shape[dim + 1 : -1]:
            inner *= s
        return RowStripes(outer=outer, world=world, chunk=shape[dim] // world * inner)


def tile_coords(t: Any, tiles_m: Any, tiles_n: Any, group_m: Any, minimum: Callable = min) -> tuple[Any, Any]:
    """Tile id -> (tile row, tile col) in grouped order (``group_m`` tile rows per group)."""
    width = group_m * tiles_n
    group = t // width
    first_m = group * group_m
    size = minimum(tiles_m - first_m, group_m)
    local = t % width
    return first_m + local % size, local // size


@dataclasses.dataclass(frozen=True)
class TileGrid:
    rows: int
    cols: int
    block_m: int
    block_n: int
    group_m: int = 8

    def __post_init__(self) -> None:
        for f in ("rows", "cols", "block_m", "block_n", "group_m"):
            if getattr(self, f) < 1:
                raise ValueError(f"TileGrid.{f} must be >= 1, got {getattr(self, f)}")

    @property
    def tiles_m(self) -> int:
        return cdiv(self.rows, self.block_m)

    @property
    def tiles_n(self) -> int:
        return cdiv(self.cols, self.block_n)

    @property
    def num_tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    def coords(self, t: Any, minimum: Callable = min) -> tuple[Any, Any]:
        return tile_coords(t, self.tiles_m, self.tiles_n, self.group_m, minimum)

    def row_col_ranges(self, t: int) -> tuple[slice, slice]:
        tm, tn = self.coords(t)
        return (
            slice(tm * self.block_m, min((tm + 1) * self.block_m, self.rows)),
            slice(tn * self.block_n, min((tn + 1) * self.block_n, self.cols)),
        )


def untile(buf: Any, grid: TileGrid, emit: Emit = call_op) -> Any:
    """``[num_tiles, BM, BN]`` tile buffer (tile t at slot t) -> ``[rows, cols]`` matrix.

    Full groups of ``group_m`` tile rows are one view/permute each; a last, shorter group is a
    second one; the two are concatenated along rows and the edge padding sliced away.
    """
    g = grid
    bm, bn, tn = g.block_m, g.block_n, g.tiles_n
    full_groups, rest = divmod(g.tiles_m, g.group_m)
    parts = []
    if full_groups:
        n = full_groups * g.group_m * tn
        x = emit(aten.slice.Tensor, buf, 0, 0, n) if rest else buf
        x = emit(aten.view.default, x, [full_groups, tn, g.group_m, bm, bn])
        x = emit(aten.permute.default, x, [0, 2, 3, 1, 4])
        x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
        parts.append(emit(aten.view.default, x, [full_groups * g.group_m * bm, tn * bn]))
    if rest:
        x = emit(aten.slice.Tensor, buf, 0, full_groups * g.group_m * tn, g.num_tiles) if full_groups else buf
        x = emit(aten.view.default, x, [tn, rest, bm, bn])
        x = emit(aten.permute.default, x, [1, 2, 0, 3])
        x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
        parts.append(emit(aten.view.default, x, [rest * bm, tn * bn]))
    x = parts[0] if len(parts) == 1 else emit(aten.cat.default, parts, 0)
    if g.tiles_m * bm != g.rows:
        x = emit(aten.slice.Tensor, x, 0, 0, g.rows)
    if tn * bn != g.cols:
        x = emit(aten.slice.Tensor, x, 1, 0, g.cols)
    return x


def tile_of(x: torch.Tensor, grid: TileGrid, t: int) -> torch.Tensor:
    """Tile ``t`` of matrix ``x`` zero-padded to ``[BM, BN]`` (reference and test helper)."""
    rs, cs = grid.row_col_ranges(t)
    out = x.new_zeros(grid.block_m, grid.block_n)
    out[: rs.stop - rs.start, : cs.stop - cs.start] = x[rs, cs]
    return out


@dataclasses.dataclass(frozen=True)
class WaveSchedule:
    """Execution order of a persistent GEMM over ``num_exec`` tiles and its wave groups.

    Program ``p`` of ``programs`` handles exec ids ``p, p + programs, ...``; wave ``w`` is exec ids
    ``[w * programs, (w + 1) * programs)``. ``wave_groups[g]`` is the number of waves in group g.
    With ``stripes > 1`` (reduce-scatter, all-to-all) exec id ``e`` is local tile ``e // stripes`` of
    stripe ``e % stripes``: every group then holds equally many tiles of every stripe, provided
    ``programs`` is a multiple of ``stripes``.
    """

    num_exec: int
    programs: int
    wave_groups: tuple[int, ...]
    stripes: int = 1

    def __post_init__(self) -> None:
        if self.programs < 1 or self.num_exec < 1:
            raise ValueError(f"WaveSchedule needs programs >= 1 and tiles >= 1, got {self}")
        if self.programs % self.stripes or self.num_exec % self.stripes:
            raise ValueError(
                f"WaveSchedule: programs ({self.programs}) and tiles ({self.num_exec}) must be multiples "
                f"of the stripe count ({self.stripes})"
            )
        if any(w < 1 for w in self.wave_groups) or sum(self.wave_groups) != self.num_waves:
            raise ValueError(
                f"WaveSchedule: wave_groups {self.wave_groups} must be positive and sum to the wave count "
                f"{self.num_waves} (= ceil({self.num_exec} tiles / {self.programs} programs))"
            )

    @property
    def num_waves(self) -> int:
        return cdiv(self.num_exec, self.programs)

    def exec_ranges(self) -> list[tuple[int, int]]:
        """Per group, the half-open range of exec ids it covers."""
        out, wave = [], 0
        for n in self.wave_groups:
            out.append((wave * self.programs, min((wave + n) * self.programs, self.num_exec)))
            wave += n
        return out

    def local_ranges(self) -> list[tuple[int, int]]:
        """Per group, the half-open range of per-stripe local tile ids it covers."""
        return [(a // self.stripes, b // self.stripes) for a, b in self.exec_ranges()]

    def group_of(self, e: int) -> int:
        return self.wave_to_group()[e // self.programs]

    def wave_to_group(self) -> list[int]:
        return [g for g, n in enumerate(self.wave_groups) for _ in range(n)]

    def send_slot(self, e: int) -> int:
        """Slot of exec id ``e`` in the send buffer: each group is contiguous, and inside a group
        the tiles of stripe k form the k-th of ``stripes`` equal chunks (what the collective needs)."""
        a, b = self.exec_ranges()[self.group_of(e)]
        local, k = divmod(e, self.stripes)
        per_stripe = (b - a) // self.stripes
        return a + k * per_stripe + (local - a // self.stripes)


def even_wave_groups(num_waves: int, groups: int) -> tuple[int, ...]:
    """Split ``num_waves`` into ``groups`` nearly equal positive parts (larger ones last)."""
    groups = max(1, min(groups, num_waves))
    base, extra = divmod(num_waves, groups)
    return tuple(base + (1 if i >= groups - extra else 0) for i in range(groups))


def subtile_rows(grid: TileGrid, world: int) -> TileGrid:
    """FlashOverlap's subtile reduce-scatter (FlashOverlap section 3.3.4): each [BM, BN] tile of the
    ``grid`` (the whole [M, N] matrix, M % BM == 0, BM % W == 0) is cut into W row subtiles and
    subtile k goes to rank k. Rank k's received tiles form this grid: its local row
    ``tm * (BM / W) + i`` is global row ``tm * BM + k * (BM / W) + i``."""
    if grid.rows % grid.block_m or grid.block_m % world:
        raise ValueError(f"subtile layout needs M % block_m == 0 and block_m % W == 0, got M={grid.rows}, "
                         f"block_m={grid.block_m}, W={world}")
    return TileGrid(grid.rows // world, grid.cols, grid.block_m // world, grid.block_n, grid.group_m)


def subtile_fix(gathered: Any, rows: int, cols: int, block_m: int, world: int, emit: Emit = call_op) -> Any:
    """Undo the subtile row order after an all-gather (dim 0) of the ranks' subtile rows: the
    gathered ``[M, N]`` holds rank k's local row ``tm * (BM/W) + i`` at ``k * M/W + tm * (BM/W) + i``,
    which belongs at ``tm * BM + k * (BM/W) + i``: a view/permute, fusable into the consumer."""
    x = emit(aten.view.default, gathered, [world, rows // block_m, block_m // world, cols])
    x = emit(aten.permute.default, x, [1, 0, 2, 3])
    x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
    return emit(aten.view.default, x, [rows, cols])


# ---- tile_fused (TileLink) rank-ordered tile schedule ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankOrderedTiles:
    """tile_fused's static tile map (TileLink, MLSys '25). A GEMM over ``world`` row stripes of
    ``tiles`` tiles each is walked stripe by stripe from stripe ``(rank + first) % world``:
    reduce-scatter (``first = 1``) the peers' stripes first and my own last; all-gather
    (``first = 0``) my own shard first, then the peers' in copy-engine order. Exec id ``e``::

        step(e)    = e // tiles
        stripe(e)  = (rank + first + e // tiles) % world      (the rank that owns / sent the rows)
        local(e)   = e % tiles                                (tile id inside the stripe, grouped order
                                                               by tiling.tile_coords)
        channel(e) = e % channels                             (which communication CTA handles it)
        slot(d, t) = d * tiles + t                            (flag and tile-buffer index, stripe-major)

    and back: ``exec_id(d, t) = ((d - rank - first) % world) * tiles + t``; ``//``, ``%``, ``*``, ``+`` only.
    """

    world: int
    rank: int
    tiles: int
    first: int
    channels: int = 1

    @property
    def num_exec(self) -> int:
        return self.world * self.tiles

    def step(self, e: Any) -> Any:
        return e // self.tiles

    def stripe(self, e: Any) -> Any:
        return (self.rank + self.first + e // self.tiles) % self.world

    def local(self, e: Any) -> Any:
        return e % self.tiles

    def channel(self, e: Any) -> Any:
        return e % self.channels

    def slot(self, stripe: Any, t: Any) -> Any:
        return stripe * self.tiles + t

    def exec_id(self, stripe: Any, t: Any) -> Any:
        return ((stripe - self.rank - self.first) % self.world) * self.tiles + t
