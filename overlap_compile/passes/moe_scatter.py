"""Fill each MoE section's dispatch buffer with templates/moe_fused/scatter.py instead of ATen's
atomic index kernel: a store per row for slots with one writer, an atomic add only where a slot
has several (exact; the module there says why). Before (demo.moe's post-grad forward)::

    full_default = full([rows, H], 0)
    index_put = index_put(full_default, [slot], src, True)          # accumulate
    all_to_all_single = all_to_all_single(index_put, ...)            # or moe_fused(index_put, ...)

After::

    moe_scatter_rows = overlap_compile.moe_scatter_rows(slot, src, rows)
    all_to_all_single = all_to_all_single(moe_scatter_rows, ...)

``index_add(full(0), 0, slot, src)`` and the backward's buffer (zeros via recompute_zeros.py) are
taken too. Only CUDA buffers of verified sections (``buffer_node``), 1-D index, 2-D rows of the
buffer's dtype; never under ``torch.use_deterministic_algorithms``. The rest gets its reason.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import is_zero_fill, val
from .matches import Match, MoeSectionMatch

aten = torch.ops.aten

# where the buffer is rewritten: CUDA only (tests on CPU widen it to check the graph surgery)
DEVICES: tuple[str, ...] = ("cuda",)


def scatter_moe_buffers(graph: fx.Graph, matches: list[Match], devices: tuple[str, ...] | None = None) -> list[str]:
    """Rewrite every verified MoE section's buffer (module doc; a backward section's is the
    gradient of the combine's gather) whose tensors live on one of ``devices`` (default
    ``DEVICES``); one line per section: what was done, or why not."""
    devices = DEVICES if devices is None else devices
    lines = []
    for m in matches:
        if not isinstance(m, MoeSectionMatch) or m.buffer_node is None:
            continue
        node = m.buffer_node
        why = _refusal(node, devices)
        if why:
            lines.append(f"{node.name}: dispatch buffer left as written ({why})")
            continue
        index, src, rows = _operands(node)
        from ..templates.moe_fused import scatter  # noqa: F401  (registers the op)

        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.overlap_compile.moe_scatter_rows.default, (index, src, rows))
        new.meta["val"] = val(node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        lines.append(f"{node.name}: dispatch buffer [{rows}, {val(src).shape[1]}] filled by moe_scatter_rows "
                     f"(a store per slot with one writer) instead of {node.target._opname} with accumulate")
    if lines:
        graph.lint()
    return lines


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, int]:
    """(index, src, rows) of an index_put / index_add into zeros (``_refusal`` checked the form)."""
    if node.target is aten.index_put.default:
        base, (index,), src = node.args[0], node.args[1], node.args[2]
    else:
        base, _, index, src = node.args[:4]
    return index, src, int(val(base).shape[0])


def _refusal(node: fx.Node, devices: tuple[str, ...]) -> str | None:
    if torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms is on: a slot's writers would sum in the order their atomics land"
    if node.op != "call_function" or node.target not in (aten.index_put.default, aten.index_add.default):
        return f"made by {getattr(node.target, '__name__', node.target)}, not index_put / index_add with accumulate"
    if node.target is aten.index_put.default:
        if len(node.args) < 4 or node.args[3] is not True or len(node.args[1]) != 1 or node.args[1][0] is None:
            return "index_put without accumulate, or with more than one index"
    elif node.args[1] != 0 or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 4:
        return "index_add along a dim other than 0 or with an alpha"
    index, src, _ = _operands(node)
    base = node.args[0]
    if not is_zero_fill(base):
        return "the rows are not added into zeros"
    out, idx, rows = val(node), val(index), val(src)
    if out is None or idx is None or rows is None:
        return "no shapes recorded on the graph"
    if out.device.type not in devices:
        return f"on {out.device.type} (rewritten on {', '.join(devices)} only)"
    if out.dim() != 2 or idx.dim() != 1 or rows.dim() != 2 or rows.shape[0] != idx.shape[0] \
            or rows.shape[1] != out.shape[1] or rows.dtype != out.dtype \
            or idx.dtype not in (torch.int64, torch.int32) or not out.dtype.is_floating_point:
        return (f"shapes or dtypes not [rows, H] <- [n] index, [n, H] rows of one floating dtype "
                f"(buffer {tuple(out.shape)} {out.dtype}, index {tuple(idx.shape)} {idx.dtype}, "
                f"rows {tuple(rows.shape)} {rows.dtype})")
    return None
