"""A Mixtral-style expert-parallel MoE layer, written the way people write it.

Per rank (W ranks, ``num_experts`` experts, ``E_local = num_experts / W`` on each rank)::

    logits = x @ router.T ; top-k of softmax(logits) -> (expert, weight) per token and choice
    position of each choice inside its expert = cumsum over a one-hot, in token order; choices
        past the capacity C = ceil(tokens * top_k / num_experts * capacity_factor) are dropped
    dispatch buffer [num_experts, C, H] = scatter of the kept choices (empty slots stay zero)
    all_to_all_single: [W, E_local * C, H] -> this rank's experts' slots from every rank -- dispatch
    expert FFN on [E_local, W * C, H]: silu(x @ w1) * (x @ w3) @ w2 as bmm               -- SwiGLU
    all_to_all_single back                                                               -- combine
    y[token] = sum over its kept choices of weight * expert output

Static shapes throughout (capacity padding); ``reference`` / ``reference_forward`` are the oracles.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    return max(1, math.ceil(tokens * top_k / num_experts * capacity_factor))


def route(x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int, cap: int):
    """(slot index in [num_experts * C] per choice, kept mask, weights), choices in token order."""
    probs = F.softmax(x.float() @ router.float().t(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)                     # [T, k]
    flat = experts.reshape(-1)                                       # choice order: token-major
    onehot = F.one_hot(flat, num_experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1               # place inside its expert
    kept = position < cap
    slot = flat * cap + position.clamp(max=cap - 1)
    return slot, kept, weights.reshape(-1).to(x.dtype)


def combine(out_slots: torch.Tensor, slot, kept, weights, tokens: int, top_k: int) -> torch.Tensor:
    picked = out_slots[slot] * (weights * kept.to(weights.dtype))[:, None]
    return picked.view(tokens, top_k, -1).sum(1)


class ExpertParallelMoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, capacity_factor: float,
                 group_name: str, world: int | None = None, rank: int | None = None) -> None:
        super().__init__()
        if world is None or rank is None:  # from the group (it must be initialised then)
            from ..runtime.comm import rank_and_size

            r, size = rank_and_size(group_name)
            world, rank = size if world is None else world, r if rank is None else rank
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the world size ({world})")
        self.hidden, self.num_experts, self.top_k, self.cf = hidden, num_experts, top_k, capacity_factor
        self.group_name, self.world, self.rank = group_name, world, rank
        e_local = num_experts // world
        self.router = nn.Parameter(torch.randn(num_experts, hidden) / hidden ** 0.5)
        self.w1 = nn.Parameter(torch.randn(e_local, hidden, ffn) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(e_local, hidden, ffn) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e_local, ffn, hidden) / ffn ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        shape = x.shape
        x = x.reshape(-1, self.hidden)
        tokens, e_local, w = x.shape[0], self.num_experts // self.world, self.world
        cap = capacity(tokens, self.num_experts, self.top_k, self.cf)
        slot, kept, weights = route(x, self.router, self.num_experts, self.top_k, cap)
        src = x.repeat_interleave(self.top_k, dim=0) * kept.to(x.dtype)[:, None]
        buf = x.new_zeros(self.num_experts * cap, self.hidden).index_add(0, slot, src)
        split = [e_local * cap] * w
        got = all_to_all_single_autograd(buf, split, split, self.group_name)             # dispatch
        # [W sources, E_local, C, H] -> [E_local, W * C, H]: each local expert's slots from all sources
        h = got.view(w, e_local, cap, self.hidden).transpose(0, 1).reshape(e_local, w * cap, self.hidden)
        h = torch.bmm(F.silu(torch.bmm(h, self.w1)) * torch.bmm(h, self.w3), self.w2)
        back = h.view(e_local, w, cap, self.hidden).transpose(0, 1).reshape(w * e_local * cap, self.hidden)
        out = all_to_all_single_autograd(back, split, split, self.group_name)             # combine
        return combine(out, slot, kept, weights, tokens, self.top_k).view(shape)

    def reference_forward(self, x: torch.Tensor, full_weights) -> torch.Tensor:
        """This layer's output on one process: ``full_weights`` = (w1, w3, w2) of all
        ``num_experts`` experts, the router is this layer's; no collective is called."""
        w1, w3, w2 = full_weights
        if w1.shape[0] != self.num_experts:
            raise ValueError(f"reference_forward: full_weights hold {w1.shape[0]} experts, the layer has {self.num_experts}")
        flat = x.reshape(1, -1, self.hidden)
        y = self.reference(flat, self.router, w1, w3, w2, self.num_experts, self.top_k, self.cf, 1)
        return y[0].view(x.shape)

    @staticmethod
    def reference(x: torch.Tensor, router, w1, w3, w2, num_experts: int, top_k: int, capacity_factor: float,
                  world: int) -> torch.Tensor:
        """The same layer on one process: ``x`` is every rank's tokens stacked [W, T, H] (routing and
        capacity are per rank, as in the parallel layer), w1/w3/w2 hold all experts."""
        outs = []
        for xr in x:
            tokens = xr.shape[0]
            cap = capacity(tokens, num_experts, top_k, capacity_factor)
            slot, kept, weights = route(xr, router, num_experts, top_k, cap)
            src = xr.repeat_interleave(top_k, dim=0) * kept.to(xr.dtype)[:, None]
            buf = xr.new_zeros(num_experts * cap, xr.shape[1]).index_add(0, slot, src).view(num_experts, cap, -1)
            h = torch.bmm(F.silu(torch.bmm(buf, w1)) * torch.bmm(buf, w3), w2).reshape(num_experts * cap, -1)
            outs.append(combine(h, slot, kept, weights, tokens, top_k))
        return torch.stack(outs)
