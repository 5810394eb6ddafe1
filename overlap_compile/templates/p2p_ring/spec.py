"""p2p_ring (CommFuse): what it supports, its configurations and the graph it emits.

Before (reduce-scatter site, sequence-parallel row-parallel linear)::

    mm = aten.mm(a, b); view = aten.view(mm, [B, S, N]); split/cat along S
    rs = _c10d_functional.reduce_scatter_tensor(cat, 'sum', W, '0'); out = _c10d_functional.wait_tensor(rs)

After::

    rows = overlap_compile.p2p_ring_gemm_collective(a, b, None, '0', '{plan}')   # [B*S/W, N]
    out = aten.view(rows, [B, S/W, N])

All-gather sites: ``p2p_ring_allgather_gemm(view(shard, [M/W, K]), [b_i], [bias_i], ...)``; no glue.
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match
from ..base import TemplateSpec, gpu_profile
from ...tiling import RowStripes
from ..plans import AllGatherGemmPlan, GemmCollectivePlan
from .reference import REDUCE_OPS, check_config

SLICE_CHOICES = (1, 2, 4)
AR_CHUNK_CHOICES = (2, 4)  # the copy-engine all-reduce's pipeline (kernels.run_allreduce)


class P2PRingSpec(TemplateSpec):
    name = "p2p_ring"
    host_replay = True  # runtime.op_graphs (base.Route(graphable=True) in op.py)
    kinds = ("gemm_reducescatter", "allgather_gemm", "gemm_alltoall", "gemm_allreduce")
    # On GPUs transport "p2p" runs kernels.py (copy engine over symmetric memory) and "nccl" with
    # slices=1 in one direction runs kernels_nccl.py; other configs run the reference (send/recv
    # from Python). GPU profiles offer the copy engine only: NCCL send/recv kernels take SMs from
    # the GEMM and ran slower than sequential (force_template with a config still runs them).
    # "slices" > 1 on the copy engine runs but has no GPU measurement, so it is not offered.
    gpu_implemented = True

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if match.kind == "gemm_allreduce":
            if match.m % match.world_size:
                return (f"p2p_ring all-reduce cuts the output into {match.world_size} row stripes: "
                        f"m={match.m} is not a multiple of the world size")
            if match.reduce_op not in REDUCE_OPS:
                return f"p2p_ring reduces with {' or '.join(REDUCE_OPS)} only, not {match.reduce_op!r}"
            return None
        if getattr(match, "stripes", None) is None:
            return "p2p_ring needs the collective's row stripes (the finder did not determine them)"
        if match.kind == "gemm_reducescatter" and match.reduce_op not in REDUCE_OPS:
            return f"p2p_ring reduces with {' or '.join(REDUCE_OPS)} only, not {match.reduce_op!r}"
        if match.kind == "gemm_alltoall" and match.stripes.outer != 1:
            return "p2p_ring all-to-all needs the split along the leading dimension"
        return None

    # The default transport is torch.distributed send/recv (NCCL on GPUs, gloo on CPU): the
    # predictor's "nccl". "p2p" (copy engine over symmetric memory) is offered by candidates().
    TRANSPORT = "nccl"

    def default_config(self, match: Match) -> dict:
        return {"slices": 1, "bidirectional": False, "transport": self.TRANSPORT}

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        """The copy-engine transport for row stripes (the predictor drops it where the group has
        no peer access); then, on the NCCL transport, slices 1, 2, 4 where they divide the rows
        of one ring message and both ring directions at once (reduce-scatter, all-gather) only
        for W > 2, where the two rings use different links. Under a GPU profile only the configs
        with a GPU path that measured faster: the copy engine (see gpu_implemented); none where the
        site has no copy-engine path (stripes not along the leading dimension). The copy engine's
        all-reduce also comes in a pipeline of ``chunks`` row chunks (kernels.run_allreduce: every
        chunk's partials pushed first, then each chunk summed and its reduced stripe sent while the
        next chunk's GEMM runs), 2 and 4 where the rows split into W stripes per chunk."""
        out = []
        if self._stripes(match).outer == 1:
            out.append({"slices": 1, "bidirectional": False, "transport": "p2p"})
            if match.kind == "gemm_allreduce":
                out += [{**out[0], "chunks": c} for c in AR_CHUNK_CHOICES if match.m % (match.world_size * c) == 0]
        if gpu_profile(profile):
            return out
        for bidir in self._directions(match):
            sizes = self._message_rows(match, bidir)
            for slices in SLICE_CHOICES:
                if all(slices <= rows and rows % slices == 0 for rows in sizes):
                    out.append({"slices": slices, "bidirectional": bidir, "transport": self.TRANSPORT})
        return out or [self.default_config(match)]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> GemmCollectivePlan | AllGatherGemmPlan:
        check_config(match.kind, config)  # a bad config fails at compile time, naming the key
        return super().plan(match, config, timeout_ms)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _stripes(match: Match) -> RowStripes:
        """The row stripes the ring moves: the collective's, or for an all-reduce the W stripes
        its reduce-scatter half cuts the output into (plans.allreduce_stripes)."""
        if match.kind == "gemm_allreduce":
            return RowStripes(1, match.world_size, match.m // match.world_size)
        return match.stripes

    @classmethod
    def _directions(cls, match: Match) -> tuple[bool, ...]:
        if match.kind == "gemm_alltoall" or match.world_size <= 2:
            return (False,)
        split = match.n if match.kind in ("gemm_reducescatter", "gemm_allreduce") else cls._stripes(match).stripe_rows
        return (False, True) if split >= 2 else (False,)

    @classmethod
    def _message_rows(cls, match: Match, bidirectional: bool) -> list[int]:
        """Rows of each ring's messages before slicing: a stripe (reduce-scatter, all-reduce,
        all-to-all) or a shard (all-gather; its two halves when bidirectional, as reference.lanes
        cuts it)."""
        rows = cls._stripes(match).stripe_rows
        if match.kind == "allgather_gemm" and bidirectional:
            return [rows // 2, rows - rows // 2]
        return [rows]


SPEC = P2PRingSpec()
