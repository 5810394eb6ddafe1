"""Every rank of a group must rewrite a site the same way, or the collectives no longer pair up.

Decisions are deterministic functions of (site signature, profile), but a rank can still differ
(different profile file, different option, other shapes, or no overlap backend at all). Before
the first run of each rewritten op, the ranks exchange a hash of the op's plan through the
group's store, bounded (ARRIVAL_TIMEOUT_S); a mismatch or a missing rank raises a clear error
naming the site and the group instead of hanging later.
"""
from __future__ import annotations

import collections
import json
import threading
import time

import torch

from ..templates.plans import plan_digest

_checked: set[tuple[str, str]] = set()
_lock = threading.Lock()
_arrivals: collections.Counter = collections.Counter()  # tag -> times this process asked (keys stay fresh)
_sequence: collections.Counter = collections.Counter()  # group -> plan checks so far (the store keys' number)
PRESENCE_TIMEOUT_S = 120.0
# A rewritten op's first call comes right after each rank's own compile, and ranks finish compiling
# at different times (2 CPU processes on 2 shared cores: more than 10 s apart, so a bound of
# signal_timeout_ms failed correct runs of the demo). The wait for a rank not there yet allows for
# that skew; a mismatch among the ranks that came is reported at once.
ARRIVAL_TIMEOUT_S = 300.0


class DecisionMismatchError(RuntimeError):
    pass


class PeerFailedError(DecisionMismatchError):
    """A rank of the group raised at a rewritten site before its plan check, so it will not come."""


def describe_site(plan_json: str, template: str) -> str:
    """A site in words from its plan: template, kind and shapes (what differs when ranks disagree)."""
    try:
        p = json.loads(plan_json)
    except ValueError:
        return f"{template} site"
    kind = p.get("kind") or ("allgather_gemm" if "ns" in p else "site")
    dims = "x".join(str(p[d]) for d in ("m", "n", "k") if d in p) or ""
    if "ns" in p:
        dims = f"{p.get('m')}x{p.get('k')} -> n={p['ns']}"
    extra = {k: p[k] for k in ("experts", "capacity", "hidden", "ffn") if k in p}
    return f"{template} {kind} {dims}{' ' + str(extra) if extra else ''} (W={p.get('world', '?')})".replace("  ", " ")


def check_plan_agreement(group_name: str, plan_json: str, template: str, timeout_ms: int | None = None) -> None:
    """Before a rewritten site's first run: every rank of the group must have the same plan.

    Each rank posts its plan's digest and the site in words to the group's store under the
    number of this check in the group (every rank reaches its checks in the same order) and
    waits, bounded by ``timeout_ms`` (signal_timeout_ms) or ARRIVAL_TIMEOUT_S, whichever is longer,
    for the others'. A rank that never
    comes (compiled without the backend, or a different graph) or one with another plan
    (other shapes, options or profile) raises DecisionMismatchError on every rank that came,
    naming the site and the group. Through the store, not a collective: a missing rank's
    collectives would otherwise pair up with this one and hang."""
    from . import teardown

    teardown.install()  # the op's resources go with its group (destroy_process_group, exit)
    digest = plan_digest(plan_json)
    key = (group_name, digest)
    with _lock:
        if key in _checked:
            return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # cannot talk to peers during capture; the warm-up run before capture checked it
    from .comm import rank_and_size

    rank, world = rank_and_size(group_name)
    site = describe_site(plan_json, template)
    if world > 1:
        store = _store()
        if store is None:
            _gather_check(group_name, plan_json, template, digest, rank, world)
        else:
            _store_check(store, group_name, site, digest, rank, world, timeout_ms, plan_json)
    with _lock:
        _checked.add(key)


def _store() -> object | None:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _store_check(store, group_name: str, site: str, digest: str, rank: int, world: int, timeout_ms: int | None,
                 plan_json: str) -> None:
    if timeout_ms is None:
        from .. import config

        timeout_ms = config.current().signal_timeout_ms
    with _lock:
        _sequence[group_name] += 1
        base = f"overlap_compile/agree/{group_name}/{_sequence[group_name]}"
    store.set(f"{base}/{rank}", json.dumps({"digest": digest, "site": site}))
    keys = [f"{base}/{r}" for r in range(world)]
    bound_ms = max(timeout_ms, ARRIVAL_TIMEOUT_S * 1000)
    deadline = time.monotonic() + bound_ms / 1000
    while not store.check(keys):
        if store.check([f"{base}/failed"]):  # a rank raised here instead of coming: say so now
            failed = json.loads(store.get(f"{base}/failed"))
            raise PeerFailedError(
                f"overlap_compile: site {site} of group {group_name!r}: rank {failed['rank']} raised there instead of "
                f"running it ({failed['error']}); rank {rank} stops here rather than wait for it.")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise DecisionMismatchError(
                f"overlap_compile: site {site} of group {group_name!r}: rank(s) {missing} did not reach it within "
                f"{bound_ms:.0f} ms (signal_timeout_ms, or {ARRIVAL_TIMEOUT_S:.0f} s for a rank still compiling, "
                f"whichever is longer) while rank {rank} did. A rank compiled without the overlap "
                f"backend, compiled another graph, or failed before this site; every rank must run the same "
                f"compiled model with the same options.")
        time.sleep(0.002)
    posted = [json.loads(store.get(k)) for k in keys]
    if len({p["digest"] for p in posted}) != 1:
        by_rank = "; ".join(f"rank {r}: {p['site']} (plan {p['digest'][:12]})" for r, p in enumerate(posted))
        raise DecisionMismatchError(
            f"overlap_compile: ranks of group {group_name!r} rewrote site {site} differently ({by_rank}). "
            f"The shapes, overlap_compile options and profile must be the same on every rank. "
            f"Plan of rank {rank}: {plan_json}")


def report_failure(group_name: str, plan_json: str, template: str, error: BaseException) -> None:
    """This rank raised at a rewritten site before its plan check (bad inputs, a plan it cannot
    run): post the error where the other ranks' check of the same site waits, so that they raise
    PeerFailedError at once, naming the site, the group and this rank, instead of waiting for it
    until ARRIVAL_TIMEOUT_S. The check's number is used up as if this rank had checked, so the
    group's later checks stay numbered alike on every rank. Best effort: without a store, nothing."""
    store = _store()
    if store is None:
        return
    try:
        from .comm import rank_and_size

        rank, world = rank_and_size(group_name)
        if world <= 1:
            return
        with _lock:
            _sequence[group_name] += 1
            base = f"overlap_compile/agree/{group_name}/{_sequence[group_name]}"
        text = f"{type(error).__name__}: {error}"[:500]
        store.set(f"{base}/failed", json.dumps({"rank": rank, "site": describe_site(plan_json, template),
                                                 "error": text}))
    except Exception:  # the rank's own error is what it raises; this is only a courtesy to the others
        pass


def _gather_check(group_name: str, plan_json: str, template: str, digest: str, rank: int, world: int) -> None:
    """Without a store (a group made without one): the digests all-gathered over the group."""
    from .comm import resolve_group

    pg = resolve_group(group_name)
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
