"""signal_reorder (FlashOverlap): what it supports, its configurations and the graph it emits.

Before (all-reduce site)::

    mm = aten.mm(a, b); view = aten.view(mm, [B, S, N])
    ar = _c10d_functional.all_reduce(view, 'sum', '0'); out = _c10d_functional.wait_tensor(ar)

After::

    buf = overlap_compile.signal_reorder_gemm_collective(a, b, None, '0', '{plan}')   # [T, BM, BN]
    ... view/permute/clone/cat/slice (tiling.untile) ...      # [M, N]; plain aten: Inductor fuses it
    out = aten.view(rows, [B, S, N])                          # into the consumer's kernel
"""
from __future__ import annotations

from typing import Any

import torch

from ...passes.matches import GemmThenCollective, Match
from ...tiling import TileGrid, cdiv, even_wave_groups, subtile_rows, untile
from ..base import TemplateSpec
from ..plans import GemmCollectivePlan


# Where the GEMM epilogue counts a wave group's tiles (kernels.SIGNAL_AT, without its
# benchmark-only "none"): kept here so specs never import kernel code.
SIGNAL_POINTS = ("group_end", "next_tile")


class SignalReorderSpec(TemplateSpec):
    name = "signal_reorder"
    host_replay = True  # runtime.op_graphs (base.Route(graphable=True) in op.py)
    kinds = ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall")

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if match.kind == "gemm_alltoall" and match.stripes.outer != 1:
            return "signal_reorder all-to-all needs the split along the leading dimension"
        return None

    def tile_rows(self, match: GemmThenCollective) -> int:
        return match.m if match.kind == "gemm_allreduce" else match.stripes.stripe_rows

    def default_config(self, match: GemmThenCollective, programs: int | None = None,
                       groups: int = 4) -> dict:
        """Tiles of 128x128 on GPU-sized problems; 16x16 on small ones so that even CPU test
        shapes have several waves. ``programs`` defaults to 4 per rank (CPU) and is set from the
        SM count by the predictor on GPUs."""
        rows = self.tile_rows(match)
        block = 128 if min(rows, match.n) >= 512 else 16
        stripes = 1 if match.kind == "gemm_allreduce" else match.world_size
        grid = TileGrid(rows, match.n, block, block, 8)
        tiles = grid.num_tiles * stripes
        if programs is None:
            programs = 4 * stripes
        programs = max(stripes, min(programs, tiles) // stripes * stripes)
        waves = cdiv(tiles, programs)
        return self.with_subtile(match, {
            "block_m": block,
            "block_n": block,
            "group_m": 8,
            "programs": programs,
            "wave_groups": list(even_wave_groups(waves, groups)),
        })

    @staticmethod
    def with_subtile(match: GemmThenCollective, config: dict) -> dict:
        """Use the subtile reduce-scatter form where the finder saw the result flow through row-wise
        ops into an all-gather (the row fix can move there) and the tiles split evenly: each
        stripe a whole number of tiles (so the tile count and waves equal the stripe form's) and
        each tile a whole number of rows per rank."""
        if match.kind != "gemm_reducescatter" or getattr(match, "subtile_ag_wait", None) is None:
            return config
        bm, w = config["block_m"], match.world_size
        if match.stripes.outer != 1 or match.stripes.chunk % bm or bm % w:
            return config
        return {**config, "rs_layout": "subtile"}

    def candidates(self, match: GemmThenCollective, profile: Any) -> list[dict]:
        """FlashOverlap Algorithm 1 (model.py): per kernel config of the profile, programs =
        (SMs - NCCL SMs) x blocks/SM (a multiple of the stripe count) and the best wave-group
        partition per group count with |G1| <= wave_group_first_max, |GP| <= wave_group_last_max
        (config.current()). Without a profile: the default config."""
        from ...predictor import model_configs
        from .model import sr_epilogue

        configs = model_configs(self.name, match, profile)
        if not configs:
            return [self.default_config(match)]
        configs = [self.with_subtile(match, c) for c in configs]
        # other signalling points (kernels.SIGNAL_AT) once the profile has measured their cost;
        # one that costs no less than group_end is dominated (it also signals a tile later) and
        # is not offered
        epi = sr_epilogue(profile) or {}
        points = [p for p in epi if p in SIGNAL_POINTS and p != "group_end" and epi[p] < epi["group_end"]]
        return configs + [dict(c, signal_at=p) for p in points for c in configs]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> GemmCollectivePlan:
        point = config.get("signal_at", "group_end")
        if point not in SIGNAL_POINTS:
            raise ValueError(f"signal_reorder: signal_at must be one of {list(SIGNAL_POINTS)}, got {point!r}")
        return super().plan(match, config, timeout_ms)

    def emit_gemm_collective(self, emit: Any, match: GemmThenCollective, plan: GemmCollectivePlan) -> Any:
        from . import reference

        buf = super().emit_gemm_collective(emit, match, plan)
        grid, _ = reference.layout(plan)
        if reference.is_subtile(plan):
            return untile(buf, subtile_rows(grid, plan.world), emit)
        if plan.kind != "gemm_alltoall":
            return untile(buf, grid, emit)
        per_source = [untile(emit(torch.ops.aten.select.int, buf, 0, j), grid, emit) for j in range(plan.world)]
        return emit(torch.ops.aten.cat.default, per_source, 0)


SPEC = SignalReorderSpec()
