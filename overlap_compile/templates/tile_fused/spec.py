"""tile_fused (TileLink, MLSys '25): what it supports, its configurations and the graph it emits.

Before (reduce-scatter site)::

    mm = aten.mm(a, b); view = aten.view(mm, [B, S, N]) [-> split/cat]
    rs = _c10d_functional.reduce_scatter_tensor(view, 'sum', W, '0'); out = _c10d_functional.wait_tensor(rs)

After::

    rows = overlap_compile.tile_fused_gemm_collective(a, b, None, '0', '{plan}')   # [B*S/W, N]
    out = aten.view(rows, [B, S/W, N])

All-reduce sites: the same op, ``[M, N]`` (M a multiple of W); all-gather sites:
``tile_fused_allgather_gemm(view(shard, [M/W, K]), [b_i], [bias_i], ...)``; no glue. Config:
``block_m``/``block_n``/``group_m`` (the GEMM tile, also the unit of signals and pushes) and
``comm_ctas`` (CTAs that push and reduce; the GEMM gets the other SMs).
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match
from ..base import TemplateSpec, gpu_profile
from ..plans import AllGatherGemmPlan, GemmCollectivePlan
from .reference import REDUCE_OPS, check_config

COMM_CTA_CHOICES = (4, 8, 16)
_SLOWER = ("tile_fused GEMM + {what}: right on every call of its 2-GPU race loops, but measured several times slower "
           "than the sequential GEMM then NCCL on H200s (benchmarks/RESULTS.md: its GEMM, which pushes and reduces "
           "its own tiles, runs far below cuBLAS), so GPU profiles do not offer it (force_template included) and the "
           "site stays as written; the CPU reference still runs it")
# kinds shown right on every call but measured slower than the site as written: not offered on GPUs
GPU_UNPROVEN = {"gemm_reducescatter": _SLOWER.format(what="reduce-scatter"),
                "gemm_allreduce": _SLOWER.format(what="all-reduce")}
# True since tests/gpu/test_tile_fused.py::test_race_loop_every_call_right[2-allgather_gemm] passed
# on 2 GPUs; False leaves tile_fused all-gather sites as written on GPU profiles.
ALLGATHER_RACE_LOOP_PASSED = True
ALLGATHER_REFUSAL = (
    "tile_fused all-gather + GEMM timed out in its 2-GPU race loop (the GEMM's wait on a peer's chunk read 0: "
    "its persistent GEMM held every SM while the call's second barrier kernel, which the chunk copies wait for, "
    "was queued behind it). The fix (ranks meet before the GEMM starts, one SM left free) has not passed "
    "tests/gpu/test_tile_fused.py's race loops on 2 GPUs yet, so the site stays as written on GPUs "
    "(force_template included); the CPU reference still runs it")


class TileFusedSpec(TemplateSpec):
    name = "tile_fused"
    host_replay = True  # runtime.op_graphs (base.Route(graphable=True) in op.py)
    kinds = ("gemm_reducescatter", "gemm_allreduce", "allgather_gemm")
    # GPU profiles offer a kind only once its GPU kernels are shown right on every call
    # (GPU_UNPROVEN, ALLGATHER_RACE_LOOP_PASSED); until then the site stays as written there.
    gpu_implemented = True

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if match.kind == "gemm_allreduce":
            if match.m % match.world_size:
                return (f"tile_fused all-reduce cuts the output into {match.world_size} row stripes: "
                        f"m={match.m} is not a multiple of the world size")
        elif getattr(match, "stripes", None) is None:
            return "tile_fused needs the collective's row stripes (the finder did not determine them)"
        if match.kind in ("gemm_reducescatter", "gemm_allreduce") and match.reduce_op not in REDUCE_OPS:
            return f"tile_fused reduces with {' or '.join(REDUCE_OPS)} only, not {match.reduce_op!r}"
        return None

    def gpu_refusal(self, match: Match) -> str | None:
        """Refused on GPUs until the 2-GPU race loops of tests/gpu/test_tile_fused.py (1,000 calls
        per case, inputs changing every call) pass: GEMM + reduce-scatter / all-reduce
        (GPU_UNPROVEN), all-gather + GEMM (ALLGATHER_RACE_LOOP_PASSED)."""
        if match.kind in GPU_UNPROVEN:
            return GPU_UNPROVEN[match.kind]
        if match.kind == "allgather_gemm" and not ALLGATHER_RACE_LOOP_PASSED:
            return ALLGATHER_REFUSAL
        return None

    @staticmethod
    def blocks(rows: int, n: int) -> tuple[int, int]:
        """128x256 / 128x128 tiles (the Hopper GEMM's anchor configs, which the latency model's
        GEMM prices assume) wherever a stripe and N reach a tile; 16x16 only on problems smaller
        than that (CPU test shapes, which then still have several tiles per stripe). A symbolic
        site's bucket keeps the config of its representative M for every M of the bucket, so a
        small representative must not pick tiles that would starve a larger M."""
        if min(rows, n) < 128:
            return 16, 16
        return 128, 256 if n >= 2048 else 128

    def default_config(self, match: Match, comm_ctas: int = 8) -> dict:
        rows = match.m // match.world_size if match.kind == "gemm_allreduce" else match.stripes.stripe_rows
        n = max(c.n for c in match.consumers) if match.kind == "allgather_gemm" else match.n
        bm, bn = self.blocks(rows, n)
        return {"block_m": bm, "block_n": bn, "group_m": 8, "comm_ctas": comm_ctas}

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        """Reduce-scatter and all-reduce: a few comm CTA counts (fewer: faster GEMM, slower
        pushes); none under a GPU profile (see gpu_implemented). All-gather: the copy engine moves
        the data, so one config."""
        if match.kind == "allgather_gemm":
            return [self.default_config(match)]
        if gpu_profile(profile):
            return []
        return [self.default_config(match, c) for c in COMM_CTA_CHOICES]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> GemmCollectivePlan | AllGatherGemmPlan:
        check_config(config)  # a bad config fails at compile time, naming the key
        return super().plan(match, config, timeout_ms)


SPEC = TileFusedSpec()
