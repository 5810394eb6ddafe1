"""moe_fused: what it supports, its configurations and the graph it emits.

Before (an inference forward graph of demo.moe's layer)::

    a2a = all_to_all_single(buf, ...); w = wait_tensor(a2a); h = view/permute/clone/view(w)
    y = bmm(silu(bmm(h, w1)) * bmm(h, w3), w2); a2a_c = all_to_all_single(view/permute(y)); out = wait(a2a_c)

After (in training graphs also returning what backward saves, ``MoePlan.saves``, getitem 1..)::

    out = overlap_compile.moe_fused(buf, w1, w3, w2, '0', '{plan}')

The backward section (passes.find_moe_backward), before::

    a2a = all_to_all_single(grad_buf, ...); g = view/permute/clone/view(wait_tensor(a2a))
    dw2 = bmm(act_t, g); d_act = bmm(g, w2t)
    d_up = d_act * silu(gate); d_gate = d_act * up * silu'(gate)   (Inductor's decomposition, casts in bf16)
    dw3 = bmm(tokens_t, d_up); dw1 = bmm(tokens_t, d_gate); d_h = bmm(d_up, w3t) + bmm(d_gate, w1t)
    a2a_r = all_to_all_single(view/permute/clone/view(d_h), ...); d_buf = wait_tensor(a2a_r)

After::

    outs = overlap_compile.moe_fused_backward(grad_buf, tokens_t, gate, up, act_t, w1t, w3t, w2t, '0', '{plan}')
    d_buf, dw1, dw3, dw2 = outs[0], outs[1], outs[2], outs[3]

Forward configs: ``{"split": "source"}`` [+ ``"transport": "p2p"``, ``"experts": "fused"|"packed"``]
or ``{"pieces": p}``; backward: ``{"split": "source"}`` (backward_spec.py). GPU profiles offer what
measured faster (copy engine with bmm, or packed for bf16 under CUDA graphs); the rest stay
reachable through force_config.
"""
from __future__ import annotations

from typing import Any

from ...passes.matches import Match, MoeSectionMatch
from ..base import TemplateSpec, gpu_profile
from ..plans import MoePlan
from . import backward_spec
from .backward_spec import is_backward


class MoeFusedSpec(TemplateSpec):
    name = "moe_fused"
    kinds = ("moe",)
    gpu_implemented = True
    # op.py replays the copy-engine path from per-site CUDA graphs (runtime.op_graphs): one
    # dispatch and one graph launch per host-launched call instead of every piece's launches
    host_replay = True
    # The backward's copy-engine path replays the same way (backward_op.py), but host-launched
    # training steps with both sections replayed ran slower than with the forward's alone (cause
    # not found): off, the backward op runs piece by piece and is priced so
    backward_host_replay = False

    def replays(self, direction: str) -> bool:
        """Whether host-launched copy-engine calls of ``direction``'s op replay (op.py, backward_op.py)."""
        return self.host_replay and (direction == "forward" or self.backward_host_replay)

    def replays_on_host(self, match) -> bool:
        return self.replays("backward" if is_backward(match) else "forward")

    def supports(self, match: Match) -> str | None:
        reason = super().supports(match)
        if reason:
            return reason
        if not isinstance(match, MoeSectionMatch) or match.buffer_node is None:
            return "moe_fused takes the SwiGLU expert section of demo.moe's form (or its backward) only"
        return None

    def default_config(self, match: Match) -> dict:
        return {"split": "source"}

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        if is_backward(match):
            return backward_spec.candidates(match, profile, self.replays_on_host(match))
        if gpu_profile(profile):  # the paths measured faster on GPUs (module doc)
            return backward_spec.gpu_candidates(match, self.replays_on_host(match))
        cap = getattr(match, "capacity", 1)
        routed = [{"split": "source", "payload": "routed"}]
        return [{"split": "source"}] + routed + [{"pieces": p} for p in (2, 4) if p <= cap]

    def plan(self, match: Match, config: dict, timeout_ms: int) -> MoePlan:
        check_config(config)
        if is_backward(match):
            return backward_spec.plan(self.name, match, config, timeout_ms)
        saves = tuple(getattr(match, "saved_nodes", {}))
        return MoePlan(template=self.name, world=match.world_size, e_local=match.e_local, capacity=match.capacity,
                       hidden=match.hidden, ffn=match.ffn, config=dict(config), timeout_ms=timeout_ms, saves=saves)


    def workspace_bytes(self, match: Match, config: dict) -> dict | None:
        """The buffers each path holds (FlashDMoE's memory-overhead accounting, Table 6.2), beside
        what the section as written allocates for its intermediates (the dispatched and combined
        slots, the three expert GEMM outputs)."""
        if is_backward(match):
            return backward_spec.workspace(match)
        w, e, c, h, f = match.world_size, match.e_local, match.capacity, match.hidden, match.ffn
        item = match.itemsize
        slot = e * c * h * item  # one source's slots
        written = (3 * w * slot) + 3 * w * e * c * f * item
        if "pieces" in config:  # sends, receives, results, returns: one full set over the pieces
            return {"persistent": 0, "per_call": 4 * w * slot, "section_as_written": written}
        if config.get("transport") != "p2p":  # NCCL by source: a receive and a result per peer piece
            return {"persistent": 0, "per_call": 2 * (w - 1) * slot, "section_as_written": written}
        symmetric = 2 * w * slot  # send + combine buffers
        flags = 2 * 2 * w * 4
        if config.get("experts") == "fused":
            from .expert_kernel import ExpertTiles

            bm = ExpertTiles(**config.get("tiles", {})).block_m
            counters = (w * e + w * e * -(-c // bm) + w + 5 + 1) * 4  # arrival, act_done, y_done, err, ticket
            per_call = 2 * w * slot + w * e * c * f * item  # x, y, act
            if config.get("skip_padding"):  # the published sizes (symmetric) and the landed ones
                symmetric += w * e * 4
                per_call += w * e * 4
            return {"persistent": symmetric + flags + counters, "per_call": per_call, "section_as_written": written}
        per_call = 2 * (w - 1) * slot
        if config.get("experts") == "packed":  # one piece's packed tokens, gate, up, act and result
            per_call += e * c * (2 * h + 3 * f) * item
        return {"persistent": symmetric + flags, "per_call": per_call, "section_as_written": written}


SPEC = MoeFusedSpec()


TRANSPORTS = ("nccl", "p2p")


EXPERTS = ("bmm", "fused", "packed")  # cuBLAS bmm / expert_kernel.py / grouped GEMMs on routed rows (packed.py)


PAYLOADS = ("capacity", "routed")  # every slot travels / only the routed rows (routed.py)


def check_config(config: dict) -> None:
    pieces = config.get("pieces")
    by_source = (config.get("split") == "source"
                 and set(config) <= {"split", "transport", "experts", "tiles", "payload", "skip_padding"}
                 and config.get("transport", "nccl") in TRANSPORTS)
    if by_source and "payload" in config:
        if config["payload"] not in PAYLOADS or (config["payload"] == "routed" and
                                                 ("transport" in config or "experts" in config)):
            raise ValueError(f"moe_fused: 'payload' must be one of {list(PAYLOADS)}; 'routed' goes with "
                             f"{{'split': 'source'}} alone (its pieces travel over NCCL / the functional "
                             f"collectives, its experts are grouped GEMMs); got {config!r}")
    if by_source and ("experts" in config or "tiles" in config):
        # the persistent expert kernel (expert_kernel.py) runs on the copy-engine path only
        if config.get("transport") != "p2p" or config.get("experts") not in EXPERTS:
            raise ValueError(f"moe_fused: 'experts' must be one of {list(EXPERTS)}, with 'transport': 'p2p'; "
                             f"got {config!r}")
        if "tiles" in config:
            from .expert_kernel import ExpertTiles

            tiles = config["tiles"]
            if config["experts"] != "fused" or not isinstance(tiles, dict):
                raise ValueError(f"moe_fused: 'tiles' (a dict of expert_kernel.ExpertTiles fields) goes with "
                                 f"'experts': 'fused'; got {config!r}")
            try:
                ExpertTiles(**tiles)
            except (TypeError, ValueError) as e:
                raise ValueError(f"moe_fused: bad 'tiles' {tiles!r}: {e}") from None
    if by_source and "skip_padding" in config and (config.get("experts") != "fused"
                                                   or not isinstance(config["skip_padding"], bool)):
        raise ValueError(f"moe_fused: 'skip_padding' (true or false) goes with 'experts': 'fused' (the persistent "
                         f"expert kernel skips the tiles past each (source, expert)'s routed rows); got {config!r}")
    by_capacity = set(config) == {"pieces"} and isinstance(pieces, int) and not isinstance(pieces, bool) and pieces >= 1
    if not (by_source or by_capacity):
        raise ValueError(f"moe_fused: config must be {{'split': 'source'}} (optionally with 'transport' one of "
                         f"{list(TRANSPORTS)} or 'payload' one of {list(PAYLOADS)}) or {{'pieces': int >= 1}}, "
                         f"got {config!r}")
