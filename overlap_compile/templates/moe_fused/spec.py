"""moe_fused: what it supports, its configurations and the graph it emits.

Before (an inference forward graph of demo.moe's layer)::

    a2a = all_to_all_single(buf, ...); w = wait_tensor(a2a); h = view/permute/clone/view(w)
    y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2); a2a_c = all_to_all_single(view/permute(y)); out = wait(a2a_c)

After::

    out = overlap_compile.moe_fused(buf, w1, w3, w2, '0', '{plan}')

Only sections whose intermediates stay inside (no saved activations: inference / prefill) are
found supported (passes.find_moe). Configurations: ``{"split": "source"}`` (one piece per source
rank, the own tokens first, no transfer; ``"transport": "p2p"`` moves the pieces by copy engine,
kernels.py, GPU profiles only) or ``{"pieces": p}`` (the capacity axis in p slices); see
reference.py. Latency model: predictor.models.moe_fused. kernels_nccl.py (NCCL on CUDA streams)
passes its GPU tests on 2x H200 but measured 0.82-0.94x of the layer as written (forward,
capacity pieces; benchmarks/results/moe-*-2026-11-23.json); kernels.py (copy engine) has not run
on GPUs yet. So gpu_implemented stays False: under GPU profiles only force_template picks it.
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match, MoeSectionMatch
from ..base import TemplateSpec, gpu_profile
from ..plans import MoePlan


class MoeFusedSpec(TemplateSpec):
    name = "moe_fused"
    kinds = ("moe",)
    gpu_implemented = False

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if not isinstance(match, MoeSectionMatch) or match.buffer_node is None:
            return "moe_fused takes the SwiGLU expert section of demo.moe's form only"
        return None

    def default_config(self, match: Match) -> dict:
        return {"split": "source"}

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        cap = getattr(match, "capacity", 1)
        copy_engine = [{"split": "source", "transport": "p2p"}] if gpu_profile(profile) else []
        return copy_engine + [{"split": "source"}] + [{"pieces": p} for p in (2, 4) if p <= cap]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> MoePlan:
        check_config(config)
        return MoePlan(template=self.name, world=match.world_size, e_local=match.e_local, capacity=match.capacity,
                       hidden=match.hidden, ffn=match.ffn, config=dict(config), timeout_ms=timeout_ms)


SPEC = MoeFusedSpec()


TRANSPORTS = ("nccl", "p2p")


def check_config(config: dict) -> None:
    pieces = config.get("pieces")
    by_source = (config.get("split") == "source" and set(config) <= {"split", "transport"}
                 and config.get("transport", "nccl") in TRANSPORTS)
    by_capacity = set(config) == {"pieces"} and isinstance(pieces, int) and not isinstance(pieces, bool) and pieces >= 1
    if not (by_source or by_capacity):
        raise ValueError(f"moe_fused: config must be {{'split': 'source'}} (optionally with 'transport' one of "
                         f"{list(TRANSPORTS)}) or {{'pieces': int >= 1}}, got {config!r}")
