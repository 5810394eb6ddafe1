"""What a model builder returns to the end-to-end benchmark, and the gradient sync it may need."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def _nothing() -> None:
    return None


@dataclasses.dataclass
class Built:
    model: torch.nn.Module
    x: Any                                   # this rank's input (a DTensor or a plain local shard)
    to_local: Callable[[Any], torch.Tensor]  # output -> this rank's local tensor (for the loss)
    tokens: int                              # tokens the whole group processes per step
    # called between backward and the optimizer step (eager, outside the compiled graphs): the
    # gradient reductions a hand-written parallel model owes its replicated weights, as Megatron-LM
    # does in finalize_model_grads. DTensor models do theirs themselves (Partial -> Replicate).
    finalize_grads: Callable[[], None] = _nothing
    # a model its framework compiles itself (torchtitan's per-block compile): compile_with(backend,
    # async_tp) compiles it in place and the benchmark calls the model as it is; None: the
    # benchmark wraps the model in torch.compile
    compile_with: Callable[..., None] | None = None


def local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_grads(params: list[torch.nn.Parameter], group_name: str) -> None:
    """Sum the gradients of ``params`` over the group, in one flat collective (few, small tensors)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_resolve_process_group(group_name))
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))
