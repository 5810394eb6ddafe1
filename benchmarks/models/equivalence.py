"""Self-check of the two Llama forms: the Megatron-style block and the DTensor block, built from
the same full weights and fed the same data, must give the same output and the same gradients
(eager, one forward + backward). Used by the tests (fp32, CPU) and as the first step of a GPU
run (bf16: the error is then bf16 rounding of differently ordered sums)."""
from __future__ import annotations

import torch

from . import build


def _grad_local(p) -> torch.Tensor:
    g = p.grad
    if hasattr(g, "placements"):  # DTensor: a Partial gradient is reduced the way the optimizer would
        from torch.distributed.tensor import Replicate

        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(g.device_mesh, [Replicate()] * len(g.placements))
        g = g.to_local()
    return g


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# parameter of the DTensor block -> the Megatron block's attribute holding the same (shard of the) weight
PAIRS = {"attention_norm.weight": "attention_norm", "ffn_norm.weight": "ffn_norm",
         "attention.wq.weight": "wq", "attention.wk.weight": "wk", "attention.wv.weight": "wv",
         "attention.wo.weight": "wo", "feed_forward.w1.weight": "w1", "feed_forward.w3.weight": "w3",
         "feed_forward.w2.weight": "w2"}


def megatron_vs_dtensor(sizes: dict, device: str, dtype, seed: int = 0) -> dict:
    """Run on every rank; returns the largest relative errors (output, input grad, weight grads)."""
    d = build("llama_dtensor", sizes, device, dtype, seed)
    m = build("llama_megatron", sizes, device, dtype, seed)
    d.x.requires_grad_(True)
    m.x.requires_grad_(True)
    yd, ym = d.to_local(d.model(d.x)), m.model(m.x)
    yd.float().pow(2).mean().backward()
    ym.float().pow(2).mean().backward()
    m.finalize_grads()
    params = dict(d.model.named_parameters())
    grads = {name: _rel(getattr(m.model, attr).grad, _grad_local(params[name])) for name, attr in PAIRS.items()}
    return {"out_rel": _rel(ym, yd), "x_grad_rel": _rel(m.x.grad, d.x.grad.to_local()), "grad_rel": grads,
            "max_rel": max([_rel(ym, yd), _rel(m.x.grad, d.x.grad.to_local()), *grads.values()])}
