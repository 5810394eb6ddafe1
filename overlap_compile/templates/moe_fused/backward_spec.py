"""What moe_fused does with a backward MoE section (passes.matches.MoeBackwardMatch): its one
configuration, its plan and the buffers it holds. spec.py hands a backward match here.

Configuration: ``{"split": "source"}`` (optionally ``"transport": "nccl"``): the forward's rounds
by source (backward_reference.py); ``"transport": "p2p"`` moves them by copy engine
(backward_p2p.py, GPU profiles only); with ``"payload": "routed"`` only the gradient rows that
reach a routed slot travel and meet the GEMMs (backward_reference.run_routed). The capacity
pieces and the persistent expert kernel have no backward path: such a config is refused with
the reason (force_config then leaves the backward section as written and says so).
"""
from __future__ import annotations

from typing import Any

from ..plans import MoePlan
from .reference import by_source

CONFIG = {"split": "source"}


def is_backward(match: Any) -> bool:
    return getattr(match, "direction", "forward") == "backward"


ROUTED = {"split": "source", "payload": "routed"}


COPY_ENGINE = {"split": "source", "transport": "p2p"}
COPY_ENGINE_PACKED = {**COPY_ENGINE, "experts": "packed"}


def gpu_candidates(match: Any, replays_on_host: bool = False) -> list[dict]:
    """The GPU profiles' configurations, either direction: the copy engine with bmm experts, and
    with the experts on the routed rows only (packed.py) where the section is bf16 (torch._grouped_mm's
    dtype on CUDA; elsewhere packed.grouped reads the group ends on the host) and its launches
    run from a CUDA graph: Inductor's (mode="reduce-overhead"), or, host-launched, the op's own
    replay (``replays_on_host``: spec.replays_on_host, with the op_graphs option on). Launched
    piece by piece, the packed pieces' dozens of small launches cost more than the padding they
    skip (spec.py). The latency model weighs the padding the packed GEMMs skip against the rows
    they move (model.packed_overhead_ms)."""
    from ... import config
    from ...predictor.launch import launch_mode
    from ...predictor.models import dtype_name

    out = [dict(COPY_ENGINE)]
    graphed = launch_mode() == "cuda_graph" or (replays_on_host and config.current().op_graphs)
    if graphed and dtype_name(getattr(match, "dtype", None)) == "bfloat16":
        out.append(dict(COPY_ENGINE_PACKED))
    return out


def candidates(match: Any, profile: Any, replays_on_host: bool = False) -> list[dict]:
    from ..base import gpu_profile

    if gpu_profile(profile):  # the forward's GPU paths, the copy engine (spec.py's module doc)
        return gpu_candidates(match, replays_on_host)
    return [dict(CONFIG), dict(ROUTED)]


def plan(template: str, match: Any, config: dict, timeout_ms: int) -> MoePlan:
    # (spec.check_config has checked the payload's and transport's values before handing a
    # backward match here)
    if (not by_source(config) or set(config) - {"split", "transport", "payload", "experts"}
            or config.get("experts") not in (None, "packed")):
        raise ValueError(f"moe_fused: the backward section runs by source only ({CONFIG}, optionally with "
                         f"'transport': 'nccl' | 'p2p', 'payload': 'capacity' | 'routed' or 'experts': "
                         f"'packed'); got {config!r}")
    return MoePlan(template=template, world=match.world_size, e_local=match.e_local, capacity=match.capacity,
                   hidden=match.hidden, ffn=match.ffn, config=dict(config), timeout_ms=timeout_ms, direction="backward")


def workspace(match: Any) -> dict:
    """Per call: a received gradient piece and a d_h piece per peer, and the full gradient g
    [E, W*C, H] the dw2 GEMM reads (the pieces land apart). The section as written holds the
    received gradient and its [E, W*C, H] layout, d_h, its layout and the returned gradient (five
    of those), d_act, d_gate and d_up ([E, W*C, F] each)."""
    w, e, c, h, f = match.world_size, match.e_local, match.capacity, match.hidden, match.ffn
    item = match.itemsize
    slot = e * c * h * item  # one source's slots
    return {"persistent": 0, "per_call": 2 * (w - 1) * slot + w * slot,
            "section_as_written": 5 * w * slot + 3 * w * e * c * f * item}
