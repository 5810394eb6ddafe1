"""Every rank of a group must rewrite a site the same way, or the collectives no longer pair up.

Decisions are deterministic functions of (site signature, profile), but a rank can still differ
(different profile file, different option). Before the first run of each rewritten op, the ranks
exchange a hash of the op's plan; a mismatch raises a clear error instead of hanging later.
"""
from __future__ import annotations

import collections
import threading
import time

import torch

from ..templates.plans import plan_digest

_checked: set[tuple[str, str]] = set()
_lock = threading.Lock()
_arrivals: collections.Counter = collections.Counter()  # tag -> times this process asked (keys stay fresh)
PRESENCE_TIMEOUT_S = 120.0


class DecisionMismatchError(RuntimeError):
    pass


def check_plan_agreement(group_name: str, plan_json: str, template: str) -> None:
    from . import teardown

    teardown.install()  # the op's resources go with its group (destroy_process_group, exit)
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


def all_present(pg: object, tag: str, timeout_s: float | None = None) -> bool:
    """Whether every rank of ``pg`` reached the point named ``tag`` (the same text on every rank)
    within ``timeout_s`` of the first; every rank gets the same answer, and none waits longer.

    Measurements taken while a graph compiles run collectives that pair up only if every rank
    compiles that graph. A rank that loaded it from a compile cache instead never comes, and
    a collective would then wait for it forever; this asks through the group's store (host
    only, bounded) first. The first rank to see everyone sets the verdict "go", the first to
    time out "abandon" (an atomic compare-and-set), and every rank, a late one too, takes the
    verdict that was set. Without a store to ask, it answers True (as before it existed).
    ``timeout_s`` defaults to ``PRESENCE_TIMEOUT_S``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = dist.get_world_size(pg)
    if world <= 1:
        return True
    try:
        store = distributed_c10d._get_default_store()
    except Exception:
        return True
    with _lock:
        _arrivals[tag] += 1
        base = f"overlap_compile/present/{getattr(pg, 'group_name', '')}/{tag}/{_arrivals[tag]}"
    count_key, verdict_key = base + "/count", base + "/verdict"
    store.add(count_key, 1)
    deadline = time.monotonic() + (PRESENCE_TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        if store.check([verdict_key]):
            return store.get(verdict_key) == b"go"
        if store.add(count_key, 0) >= world:
            return store.compare_set(verdict_key, "", "go") == b"go"
        if time.monotonic() > deadline:
            return store.compare_set(verdict_key, "", "abandon") == b"go"
        time.sleep(0.005)
