"""moe_fused_backward on NVIDIA GPUs over the copy engine (config ``{"split": "source",
"transport": "p2p"}``): backward_reference.py's pieces by source moved the way kernels.py moves
the forward's, between symmetric buffers with no SMs taken from the gradient GEMMs::

    compute (call start)  stage the peers' gradient slots, handshake (kernels.open_call)
    copy stream           pull each peer's gradient piece; once its d_h is done, push it home
    compute               d_h of the own slots, d_h of each peer piece once pulled, then the
                          three weight-gradient GEMMs over all rows while the last d_h travels
    compute (call end)    the d_h of my slots, back from every peer (kernels.finish_call)

The GEMMs and their order are backward_reference.Pieces', so the results equal its own.
"""
from __future__ import annotations

import torch

from ..plans import MoePlan
from . import backward_reference as bref
from . import kernels


def run(grad_buf: torch.Tensor, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name: str,
        plan: MoePlan, outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``outs``: the op's outputs to write into (d_buf, dw1, dw3, dw2): stream work into buffers
    the caller owns is what runtime.op_graphs replays (backward_op.py)."""
    call = kernels.open_call(grad_buf, group_name, plan)
    out = torch.empty_like(call.slots) if outs is None else outs[0].view(call.slots.shape)
    pieces = bref.make_pieces(call.slots, out, call.r, plan, tokens_t, gate, up, act_t, w1t, w3t, w2t,
                              grads_into=None if outs is None else outs[1:])
    used = kernels.rounds(call, pieces.own, pieces.peer, pieces.after)
    kernels.finish_call(call, out, [grad_buf, *used])
    return pieces.result()
