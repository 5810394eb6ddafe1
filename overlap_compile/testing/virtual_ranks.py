"""W virtual ranks on ONE GPU: the cross-rank protocols of the peer-memory templates under real
concurrency, on a machine with one GPU (tests only).

    with virtual_ranks(2, torch.device("cuda", 0)) as group:
        results = group.run(lambda rank: ...)      # one host thread per rank, each on its own streams

Symmetric buffers become W ordinary buffers with one address table, so a rank's pushes, pulls and
flag writes reach its "peers" as on a real group. Per-device state (comm and copy streams,
op_graphs' capture stream and pool, moe_fused's expert counters) is kept per rank; the group
answers ``rank()`` / ``size()``; each rank's persistent grids take 1/W of the SMs; plan agreement
and the first-call barrier are skipped. Shows
flag/data pairing and call interleaving, replays included; not ordering across NVLink.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from typing import Any, Callable

import torch


class VirtualGroup:
    """What the kernels ask of a process group (this thread's rank, the size), and the runner."""

    # calls a rank's host may queue ahead before it waits for its stream: on one GPU every rank
    # shares one launch queue, and a rank far ahead could fill it with work that waits on a peer
    # whose next launch then cannot enter (separate GPUs have separate queues)
    PACE = 4

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device = world, device
        self.local = threading.local()
        self.failed = threading.Event()  # a rank failed: the others stop instead of waiting out bounds

    def pace(self, call: int) -> bool:
        """After call ``call`` of this rank: every PACE calls, wait for this rank's stream.
        False once another rank has failed (stop calling)."""
        if (call + 1) % self.PACE == 0:
            torch.cuda.current_stream(self.device).synchronize()
        return not self.failed.is_set()

    def rank(self) -> int:
        return self.local.rank

    def size(self) -> int:
        return self.world

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on one thread per rank, each on a compute stream of its own; the results
        in rank order (an exception on any rank is raised here)."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def worker(r: int) -> None:
            try:
                self.local.rank = r
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(torch.cuda.Stream(self.device)):
                    results[r] = fn(r)
                    torch.cuda.current_stream(self.device).synchronize()
            except BaseException as e:  # handed to the caller's thread
                errors.append(e)
                self.failed.set()

        threads = [threading.Thread(target=worker, args=(r,), name=f"virtual-rank-{r}") for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize(self.device)
        if errors:
            raise errors[0]
        return results


@dataclasses.dataclass
class VirtualBuffer:
    """runtime.symm.SymmBuffer's face over W plain buffers of one GPU."""

    buffers: list[torch.Tensor]
    ptrs: torch.Tensor
    group: VirtualGroup
    # SymmBuffer.memo: what callers derive from it; their keys carry the rank, which here is the
    # calling thread's
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def local(self) -> torch.Tensor:
        return self.buffers[self.rank]

    @property
    def buffer_ptrs_dev(self) -> torch.Tensor:
        return self.ptrs

    def peer(self, rank: int) -> torch.Tensor:
        return self.buffers[rank]


def _package_modules(prefix: str = "overlap_compile") -> list[Any]:
    return [m for n, m in list(sys.modules.items())
            if m is not None and (n == prefix or n.startswith(prefix + "."))]


def patch_everywhere(stack: contextlib.ExitStack, where: str, name: str, value: Any) -> None:
    """Replace the object named ``name`` in the modules under ``where`` (a package or module
    name) by ``value`` in every ``overlap_compile`` module holding it (``from x import name`` and
    ``alias = x.name`` copies included), restored when ``stack`` closes."""
    defining = [m for m in _package_modules(where) if name in vars(m)]
    if not defining:
        raise AttributeError(f"virtual_ranks: no module under {where} defines {name!r}")
    originals = {id(vars(m)[name]) for m in defining}
    for mod in _package_modules():
        for key, held in list(vars(mod).items()):
            if id(held) in originals and callable(held):
                setattr(mod, key, value)
                stack.callback(setattr, mod, key, held)


@contextlib.contextmanager
def virtual_ranks(world: int, device: torch.device):
    from .. import templates
    from ..runtime import agreement, op_graphs, peer_flags, symm  # noqa: F401  (imported: patched below)
    from ..templates.moe_fused import expert_kernel as _experts
    from ..templates.moe_fused import kernels as _moe
    from ..templates.p2p_ring import kernels as _p2p  # noqa: F401
    from ..templates.tile_fused import kernels as _tile  # noqa: F401

    templates.load_all_ops()
    group = VirtualGroup(world, device)
    lock = threading.Lock()
    buffers: dict[tuple, VirtualBuffer] = {}
    flags: dict[tuple, torch.Tensor] = {}
    _, greatest = torch.cuda.Stream.priority_range()
    per_rank: dict[tuple, Any] = {}

    def mine(what: str, make: Callable[[], Any]) -> Any:
        key = (what, group.rank())
        with lock:
            if key not in per_rank:
                per_rank[key] = make()
            return per_rank[key]

    def symm_buffer(group_name, key, shape, dtype, dev, zero=False):
        k = (key, tuple(shape), dtype)
        with lock:
            if k not in buffers:
                ts = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(world)]
                table = torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
                buffers[k] = VirtualBuffer(ts, table, group)
        return buffers[k]

    def tensor_and_ptrs(group_name, key, shape, dtype, dev, zero=False):
        buf = symm_buffer(group_name, key, shape, dtype, dev, zero)
        return buf.local, buf.ptrs

    def peer_view(group_name, t, rank):
        with lock:
            for buf in buffers.values():
                if any(b is t for b in buf.buffers):
                    return buf.buffers[rank]
        raise KeyError(f"{tuple(t.shape)} is not a virtual symmetric buffer")

    def zeros_cached(key, n, dev):
        return mine(("zeros", key), lambda: torch.zeros(n, dtype=torch.int32, device=dev))

    def moe_counters(w, e, c, block_m, dev):  # the expert kernel's signals: one set per rank, in the
        # cache moe_fused checks for failed waits at each call
        def make():  # fresh for each virtual group (an earlier group's failed call may have left counts)
            made = _experts.Counters.make(w, e, c, block_m, dev, pinned_err=True)
            _moe._counter_cache[(w, e, c, block_m, str(dev), "virtual rank", group.rank())] = made
            return made

        return mine(("moe counters", w, e, c, block_m), make)

    def high_priority_stream(dev):
        return mine(("stream", "comm"), lambda: torch.cuda.Stream(dev, priority=greatest))

    # each rank's persistent grids get its share of the SMs, as each rank of a real group has a GPU
    # of its own: sized to the whole GPU, one rank's CTAs spinning on a peer's flags could hold
    # every SM, and the peer's kernel that would set them could not start before the bound
    sm_share = max(1, torch.cuda.get_device_properties(device).multi_processor_count // world)

    with contextlib.ExitStack() as stack:
        torch.cuda.synchronize(device)
        rt, tf = "overlap_compile.runtime", "overlap_compile.templates.tile_fused"
        for where, name, value in (
            (f"{rt}.comm", "resolve_group", lambda name: group),
            (f"{rt}.comm", "rank_and_size", lambda name: (group.rank(), world)),
            (f"{rt}.symm", "symm_buffer", symm_buffer),
            (f"{rt}.symm", "tensor_and_ptrs", tensor_and_ptrs),
            (f"{rt}.symm", "peer_view", peer_view),
            (f"{rt}.symm", "usable", lambda group_name, dev, plan=None: None),
            (f"{rt}.symm", "available", lambda group_name, dev: True),
            (f"{rt}.agreement", "check_plan_agreement", lambda *a, **kw: None),
            (f"{rt}.peer_flags", "copy_stream", high_priority_stream),
            (tf, "_comm_stream", high_priority_stream),
            (tf, "_zeros_cached", zeros_cached),
            (tf, "_first_call", lambda key, pg, dev, body: None),
            (tf, "_num_sms", lambda dev: sm_share),
            ("overlap_compile.templates.moe_fused.kernels", "_counters", moe_counters),
            (f"{rt}.op_graphs", "_side_stream", lambda dev: mine(("stream", "capture"), lambda: torch.cuda.Stream(dev))),
            (f"{rt}.op_graphs", "_pool", lambda dev: mine(("pool",), torch.cuda.graph_pool_handle)),
        ):
            patch_everywhere(stack, where, name, value)
        yield group


def warm_up_tile_fused(group: VirtualGroup, calls: list[Callable[[], Any]]) -> None:
    """Compile and load every tile_fused kernel (Triton warm-up, nothing launched), rank by rank,
    before any rank's kernels spin (the first-call warm-up tile_fused does on a real group)."""
    mods = [m for n, m in list(sys.modules.items())
            if m is not None and n.startswith("overlap_compile.templates.tile_fused.") and "_warming" in vars(m)]
    for r, call in enumerate(calls):
        group.local.rank = r
        for m in mods:
            m._warming = True
        try:
            call()
        finally:
            for m in mods:
                m._warming = False
