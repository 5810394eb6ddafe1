"""priority_stream (resource-aware overlap): what it supports, its configurations, what it emits.

Before (reduce-scatter site, sequence-parallel row-parallel linear)::

    mm = aten.mm(a, b); view = aten.view(mm, [B, S, N]); split/cat along S
    rs = _c10d_functional.reduce_scatter_tensor(cat, 'sum', W, '0'); out = _c10d_functional.wait_tensor(rs)

After::

    rows = overlap_compile.priority_stream_gemm_collective(a, b, None, '0', '{plan}')   # [B*S/W, N]
    out = aten.view(rows, [B, S/W, N])

All-gather sites: ``priority_stream_allgather_gemm(view(shard, [M/W, K]), [b_i], [bias_i], ...)``; no glue.
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match
from ..base import TemplateSpec
from ..plans import AllGatherGemmPlan, GemmCollectivePlan
from .reference import KINDS, check_config

DEFAULT_CHUNKS = 4
CHUNK_CHOICES = (1, 2, 4, 8)


def rows_per_stripe(match: Match) -> int:
    """Rows one chunk count is cut from: the whole output (all-reduce) or one rank's stripe."""
    if match.kind == "gemm_allreduce":
        return match.m
    return match.stripes.stripe_rows


def _config(chunks: int) -> dict:
    # block_m/block_n/stages None: cuBLAS at its own tile choice (see reference.config_problem)
    return {"chunks": chunks, "block_m": None, "block_n": None, "stages": None}


class PriorityStreamSpec(TemplateSpec):
    name = "priority_stream"
    host_replay = True  # runtime.op_graphs (base.Route(graphable=True) in op.py)
    kinds = KINDS

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if match.kind != "gemm_allreduce" and getattr(match, "stripes", None) is None:
            return "priority_stream needs the collective's row stripes (the finder did not determine them)"
        if rows_per_stripe(match) < 1:
            return f"priority_stream needs at least one row per rank, the site has m={match.m}"
        return None

    def default_config(self, match: Match) -> dict:
        """4 chunks, fewer when a stripe has fewer rows (every chunk needs a row of every stripe)."""
        return _config(max(1, min(DEFAULT_CHUNKS, rows_per_stripe(match))))

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        """1, 2, 4, 8 chunks where each chunk gets at least one row of every stripe, on cuBLAS.

        The occupancy-shaped configs (block_m/block_n/stages/programs: the persistent Triton GEMM
        holding fewer SMs or less shared memory) run and can be forced, but are not offered: none
        beat cuBLAS chunks (holding SMs back slows the GEMM more than NCCL gains;
        benchmarks/diagnostics/occupancy_sweep.py compares them)."""
        rows = rows_per_stripe(match)
        return [_config(c) for c in CHUNK_CHOICES if c <= rows] or [self.default_config(match)]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> GemmCollectivePlan | AllGatherGemmPlan:
        check_config(config)  # a bad config fails at compile time, naming the key
        return super().plan(match, config, timeout_ms)


SPEC = PriorityStreamSpec()
