"""moe_fused: what it supports, its configurations and the graph it emits.

Before (an inference forward graph of demo.moe's layer)::

    a2a = all_to_all_single(buf, ...); w = wait_tensor(a2a); h = view/permute/clone/view(w)
    y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2); a2a_c = all_to_all_single(view/permute(y)); out = wait(a2a_c)

After::

    out = overlap_compile.moe_fused(buf, w1, w3, w2, '0', '{plan}')

Only sections whose intermediates stay inside (no saved activations: inference / prefill) are
found supported (passes.find_moe). No latency model yet: the predictor does not choose it, so it
runs only where forced (force_template="moe_fused"). Not measured on GPUs (gpu_implemented=False).
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match, MoeSectionMatch
from ..base import TemplateSpec
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
        return {"pieces": min(2, max(1, getattr(match, "capacity", 1)))}

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        cap = getattr(match, "capacity", 1)
        return [{"pieces": p} for p in (1, 2, 4) if p <= cap] or [self.default_config(match)]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> MoePlan:
        pieces = config.get("pieces")
        if set(config) != {"pieces"} or not isinstance(pieces, int) or isinstance(pieces, bool) or pieces < 1:
            raise ValueError(f"moe_fused: config must be {{'pieces': int >= 1}}, got {config!r}")
        return MoePlan(template=self.name, world=match.world_size, e_local=match.e_local, capacity=match.capacity,
                       hidden=match.hidden, ffn=match.ffn, config=dict(config), timeout_ms=timeout_ms)


SPEC = MoeFusedSpec()
