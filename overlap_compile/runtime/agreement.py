"""Every rank of a group must rewrite a site the same way, or the collectives no longer pair up.

Decisions are deterministic functions of (site signature, profile), but a rank can still differ
(different profile file, different option). Before the first run of each rewritten op, the ranks
exchange a hash of the op's plan; a mismatch raises a clear error instead of hanging later.
"""
from __future__ import annotations

import threading

import torch

from ..templates.plans import plan_digest

_checked: set[tuple[str, str]] = set()
_lock = threading.Lock()


class DecisionMismatchError(RuntimeError):
    pass


def check_plan_agreement(group_name: str, plan_json: str, template: str) -> None:
    digest = plan_digest(plan_json)
    key = (group_name, digest)
    with _lock:
        if key in _checked:
            return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # cannot talk to peers during capture; the warm-up run before capture checked it
    from .comm import rank_and_size, resolve_group

    pg = resolve_group(group_name)
    rank, world = rank_and_size(group_name)
    device = "cuda" if torch.distributed.get_backend(pg) == "nccl" else "cpu"
    mine = torch.tensor([int(digest, 16) & 0x7FFFFFFFFFFFFFFF], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(everyone, mine, group=pg)
    values = [int(t.item()) for t in everyone]
    if len(set(values)) != 1:
        raise DecisionMismatchError(
            f"overlap_compile: ranks of group {group_name!r} rewrote a site differently ({template}); "
            f"rank {rank} has plan {digest}, all ranks: {[format(v, '016x') for v in values]}. "
            f"Use the same overlap_compile options and profile on every rank. Plan of rank {rank}: {plan_json}"
        )
    with _lock:
        _checked.add(key)
