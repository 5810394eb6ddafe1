"""replay_kept: in a host-launched inference graph, a site left as written runs as priority_stream's
one-chunk op, which runtime.op_graphs replays from a CUDA graph.

Before (a site the decision kept)::

    mm = aten.mm(a, b) -> [views] -> rs = reduce_scatter_tensor(...) -> wait_tensor(rs) -> users
After::

    rows = overlap_compile.priority_stream_gemm_collective(a, b, None, group, '{"chunks": 1, ...}')

The GPU runs the same work in the same order: the GEMM whole, then the collective (on the priority
stream, joined before its result is read; the graph as written waits for it at once too). The host
pays one graph launch instead of the GEMM's launch and c10d's collective call, which is what a
prefill or decode call of a few thousand tokens or fewer, host-bound in default mode, loses to the
site as written. Symbolic sites get the same for their "as written" buckets (templates/bucketed.py,
``replay_written``). Only inference graphs (no tangents traced: a forward under no_grad or with no
input requiring grad), only CUDA sites, only with op graphs on and ``replay_written``; a training
step is left as the decision made it.
"""
from __future__ import annotations

import torch.fx as fx

from ..config import Options
from .matches import Match


def replays(options: Options) -> bool:
    """Whether sites run as written may run as the replayed op: ``replay_written`` and op graphs
    on, host-launched (under CUDA graphs a replay costs no host time). Symbolic sites' "as
    written" buckets follow this alone (BucketTable.replay_written)."""
    from ..predictor import launch_mode

    return options.replay_written and options.op_graphs and launch_mode() == "eager"


def applies(graph: fx.Graph, options: Options) -> bool:
    """Whether this graph's kept static sites are replayed: ``replays``, nothing forced, an inference graph."""
    return replays(options) and options.force_template is None and is_inference(graph)


def is_inference(graph: fx.Graph) -> bool:
    """An inference graph: AOTAutograd traced no tangents for its forward (nothing it returns needs
    a gradient) and it is no backward graph. False where that cannot be told."""
    from torch._guards import TracingContext

    if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return False
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    tangents = getattr(meta, "traced_tangents", None)
    return tangents is not None and len(tangents) == 0


def written_plan(match: Match, timeout_ms: int):
    """priority_stream's one-chunk plan for a kept site on CUDA, or None where it cannot take it."""
    from .. import templates
    from ..templates.bucketed import WRITTEN_CONFIG, WRITTEN_TEMPLATE

    spec = templates.get_spec(WRITTEN_TEMPLATE)
    if match.unsupported or match.kind not in spec.kinds or not on_gpu(match) or spec.supports(match):
        return None
    try:
        return spec.plan(match, dict(WRITTEN_CONFIG), timeout_ms)
    except ValueError:
        return None


def on_gpu(match: Match) -> bool:
    val = match.anchor().meta.get("val")
    device = getattr(val, "device", None)
    return getattr(device, "type", None) == "cuda"


NOTE = ("; runs as written as priority_stream's one-chunk op, replayed from a CUDA graph "
        "(host-launched inference graph: one launch instead of the GEMM's and the collective's host work)")
