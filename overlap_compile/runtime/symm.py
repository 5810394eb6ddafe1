"""Symmetric-memory buffers for templates that move data between GPUs without NCCL (peer copies
on the copy engine, or Triton kernels reading / writing peers' memory over NVLink).

    usable(group_name, device)     # None when this can run here, else the reason (a string)
    buf = symm_buffer(group_name, "p2p_ring/ag", (rows, k), dtype, device)
    buf.local                      # my buffer: peers read / write it
    buf.peer(rank)                 # a tensor on my device mapping that rank's buffer
    buf.rank, buf.world, buf.handle, buf.offset
    buf.ptrs / buf.buffer_ptrs_dev # int64 [world] on the device: every rank's address of the buffer
    buf.signal_pad_ptrs_dev        # int64 [world] on the device: every rank's signal pad
    buf.barrier(channel, timeout)  # every rank of the group reached this point in stream order

    buf = grown_buffer(group_name, key, (slots,), numel, dtype, device)     # room for numel per slot, grows
    face(buf.local, (rows, cols))                                           # one call's part of it
    memoized(buf, key, make)             # what a caller derives from buf once, dropped with it
    t, ptrs = tensor_and_ptrs(group_name, key, shape, dtype, device, zero=False)   # kernels' form
    peer_view(group_name, t, rank)                                                  # by tensor
    with dropped_after(device): ...      # buffers first made inside are forgotten at its end
    write_value32(flags, index, value)   # flags[index] = value in stream order (flags: uint32, 1-D,
                                         # local or a peer view), fenced so earlier work lands first

A buffer is allocated once per ``cache_key`` (group, key, shape, dtype, device) and kept for the
life of the process: allocation is collective (same buffers, same order on every rank), slow, and
refused inside a CUDA-graph capture. A tensor's address on rank q is ``buffer_ptrs[q] +
(t.data_ptr() - buffer_ptrs[rank])``; tensors may share an allocation and its signal pad, so
templates keep their flags in a ``symm_buffer`` of their own. Importing touches no CUDA or group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import threading
from typing import Any, Callable

import torch

from .persistent import allocate


@dataclasses.dataclass
class SymmBuffer:
    local: torch.Tensor
    handle: Any
    rank: int
    world: int
    offset: int          # bytes from the allocation base to ``local`` (same on every rank)
    ptrs: torch.Tensor   # int64 [world] on the device: every rank's address of this buffer
    signal_pad_ptrs_dev: torch.Tensor  # int64 [world] on the device: every rank's signal pad
    _peers: dict = dataclasses.field(default_factory=dict)
    # what callers derive from the buffer once and reuse every call (views, flag objects): kept
    # here so that it goes when the buffer is dropped (dropped_after, teardown), never outliving it
    memo: dict = dataclasses.field(default_factory=dict)
    # bytes of it that torch's symmetric allocator mapped outside the caching allocator (which
    # then does not count them in max_memory_allocated); 0 where it drew on an allocator pool
    outside: int = 0

    @property
    def buffer_ptrs_dev(self) -> torch.Tensor:
        return self.ptrs

    def peer(self, rank: int) -> torch.Tensor:
        """``rank``'s buffer, mapped into this device's address space (same shape and dtype)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"symmetric buffer: rank {rank} is outside the group (world size {self.world})")
        if rank == self.rank:
            return self.local
        view = self._peers.get(rank)
        if view is None:
            view = self._peers[rank] = self.handle.get_buffer(
                rank, tuple(self.local.shape), self.local.dtype, self.offset // self.local.element_size())
        return view

    def barrier(self, channel: int, timeout_ms: int) -> None:
        """A device-side barrier of the group on the current stream, bounded by ``timeout_ms``."""
        self.handle.barrier(channel=channel, timeout_ms=timeout_ms)


_cache: dict[tuple, SymmBuffer] = {}
_grown: dict[tuple, int] = {}  # (group, key, slots, dtype, device) -> elements per slot of grown_buffer's current one
_lock = threading.Lock()


def bytes_outside_allocator(device: torch.device | int | None = None) -> int:
    """Bytes of the symmetric buffers alive on ``device`` (default: the current one) that
    ``torch.cuda.max_memory_allocated`` does not count: add them to it for what the process holds."""
    index = torch.device(device).index if isinstance(device, (torch.device, str)) else device
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    with _lock:
        return sum(b.outside for b in _cache.values() if b.local.device.index == index)


def grown_buffer(group_name: str, key: str, slots: tuple[int, ...], numel: int, dtype: torch.dtype,
                 device: torch.device, zero: bool = False) -> SymmBuffer:
    """The buffer of ``key`` holding at least ``numel`` elements per slot (shape ``slots +
    (capacity,)``), grown to the largest request so far: calls whose sizes vary with M (a symbolic
    site's every length) share one instead of one per size. A larger request makes a larger
    buffer that later calls use; the smaller is kept, since a captured CUDA graph may address it.
    Requests come in the same order on every rank, so every rank grows at the same call.
    ``zero``: each buffer zeroed when made (symm_buffer's), for flags whose users leave them at
    zero after every call, so that the grown one starts where the smaller was left."""
    if numel < 0 or any(s < 0 for s in slots):
        raise ValueError(f"symmetric buffer {key!r}: negative size (slots {slots}, {numel} elements)")
    where = (group_name, key, tuple(slots), str(dtype), str(torch.device(device)))
    with _lock:
        cap = _grown[where] = max(_grown.get(where, 0), numel, 1)
    return symm_buffer(group_name, f"{key}/grown{cap}", (*slots, cap), dtype, device, zero)


def face(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first prod(``shape``) elements of ``t``'s last dim viewed as ``shape``: one call's part
    of a grown_buffer (its local tensor or a peer's)."""
    return t[..., :math.prod(shape)].unflatten(-1, tuple(shape))


def memoized(buf: Any, key: tuple, make: Callable[[], Any]) -> Any:
    """``buf.memo[key]``, made by ``make()`` on first use: what a caller derives from a buffer
    once (views, flag objects) goes when the buffer does. Buffers without a memo (tests' stand-ins)
    get a fresh one each time. Callers put the rank in ``key`` (one thread per virtual rank)."""
    memo = getattr(buf, "memo", None)
    got = memo.get(key) if memo is not None else None
    if got is None:
        got = make()
        if memo is not None:
            memo[key] = got
    return got


@contextlib.contextmanager
def dropped_after(device: torch.device | str | int | None):
    """Symmetric buffers first made inside the block are forgotten when it ends, once ``device``
    is idle: their memory goes as soon as no tensor refers to them (a peer's mapping of mine goes
    when it leaves its own block). For work every rank of the group runs alike that makes buffers
    nothing will use again: settle timing templates it may not choose (predictor/exhaustive.py).
    A later call of the template makes its buffers anew (collective, outside any capture)."""
    with _lock:
        before = set(_cache)
    try:
        yield
    finally:
        if device is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)
        with _lock:
            for k in [k for k in _cache if k not in before]:
                del _cache[k]


def cache_key(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> tuple:
    """What identifies a buffer: two requests with the same key share one allocation."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"symmetric buffer key must be a non-empty string, got {key!r}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"symmetric buffer {key!r}: negative size in shape {shape}")
    index = device.index if device.index is not None else 0
    return (group_name, key, shape, dtype, device.type, index)


def node_reason(world: int, gpus_here: int, blocked: list[tuple[int, int]]) -> str | None:
    """Why a group of ``world`` ranks cannot use peer memory on a node with ``gpus_here`` GPUs,
    given the GPU pairs without peer access (None: it can). Pure, so it is tested on CPU."""
    if world < 2:
        return f"a group of {world} rank has no peers to copy from"
    if world > gpus_here:
        return f"the group's {world} ranks are not all on this node ({gpus_here} GPUs here)"
    if blocked:
        i, j = blocked[0]
        return f"no peer access between GPUs {i} and {j}"
    return None


def usable(group_name: str, device: torch.device, plan: Any = None) -> str | None:
    """None when symmetric memory with peer copies can serve this group here; else why not
    (``plan``: unused, the signature every path's ``usable`` shares). Cached per (group, device):
    ops ask on every call."""
    ck = (group_name, device.type, device.index)
    with _lock:
        if ck in _usable:
            return _usable[ck]
    why = _usable_now(group_name, device)
    with _lock:
        _usable[ck] = why
    return why


_usable: dict[tuple, str | None] = {}


def _usable_now(group_name: str, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"symmetric memory needs CUDA tensors, got a {device.type} tensor"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "this torch has no symmetric memory (torch.distributed._symmetric_memory)"
    from .comm import resolve_group

    try:
        pg = resolve_group(group_name)
        if type(pg._get_backend(device)).__name__ != "ProcessGroupNCCL":
            return "symmetric memory rendezvous needs an NCCL group on CUDA tensors"
    except (RuntimeError, AttributeError) as e:
        return f"process group {group_name!r}: {e}"
    world, here = pg.size(), torch.cuda.device_count()
    # Assumes one rank per GPU, ranks 0..W-1 on GPUs 0..W-1 (what torchrun and the harness do).
    blocked = [(i, j) for i in range(min(world, here)) for j in range(min(world, here))
               if i != j and not torch.cuda.can_device_access_peer(i, j)]
    return node_reason(world, here, blocked)


def available(group_name: str, device: torch.device) -> bool:
    return usable(group_name, device) is None


def symm_buffer(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                zero: bool = False) -> SymmBuffer:
    """The cached buffer for (group, key, shape, dtype, device); created on first use (collective).
    ``zero``: zeroed on every rank before any peer can write into it (signal flags, counters)."""
    ck = cache_key(group_name, key, shape, dtype, device)
    with _lock:
        buf = _cache.get(ck)
    if buf is not None:
        return buf
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"symmetric buffer {key!r} of group {group_name!r} first needed inside a CUDA graph "
                           "capture: run the op once before capturing")
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # required by older torch, deprecated (a no-op) by newer
        import warnings

        try:
            with warnings.catch_warnings():  # newer torch's deprecation notice, on every new buffer
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)
        except Exception:
            pass
    from .comm import resolve_group

    pg = resolve_group(group_name)
    rank, world = pg.rank(), pg.size()

    def create():
        # the rendezvous allocates device tables through the caching allocator too: all of it on
        # the worker thread, outside any CUDA-graph pool (persistent.py)
        before = torch.cuda.memory_allocated(device)
        local = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        # torch's symmetric allocator maps its own memory unless it draws on a pool of the caching
        # allocator, whose statistics (max_memory_allocated) then never see it: all or nothing, so
        # another thread's allocations between the two reads cannot skew the count
        nbytes = local.untyped_storage().nbytes()
        outside = nbytes if torch.cuda.memory_allocated(device) - before < nbytes // 2 else 0
        if zero:
            local.view(-1).view(torch.uint8).zero_()  # bytes: uint32 has no CUDA fill kernel on every torch
            torch.cuda.current_stream(device).synchronize()  # zeroed before the rendezvous lets any peer see it
        handle = symm_mem.rendezvous(local, group_name)
        offset = local.data_ptr() - handle.buffer_ptrs[rank]
        ptrs = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        return local, handle, offset, ptrs, pads, outside

    local, handle, offset, ptrs, pads, outside = allocate(create)
    buf = SymmBuffer(local, handle, rank, world, offset, ptrs, pads, outside=outside)
    with _lock:
        _cache[ck] = buf
    return buf


def tensor_and_ptrs(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                    zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    buf = symm_buffer(group_name, key, shape, dtype, device, zero)
    return buf.local, buf.ptrs


def peer_view(group_name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s copy of the symmetric buffer whose local tensor is ``t``."""
    with _lock:
        for (g, *_), buf in _cache.items():
            if g == group_name and buf.local is t:
                break
        else:
            raise KeyError(f"{tuple(t.shape)} is not a symmetric buffer of group {group_name!r}")
    return buf.peer(rank)


def write_value32(flags: torch.Tensor, index: int, value: int) -> None:
    """``flags[index] = value`` on the current stream, after everything queued before it.

    ``cuStreamWriteValue32`` (torch's ``symm_mem.stream_write_value32_``): no kernel, no SM, and
    it fences earlier writes system-wide before the flag lands. It is used under CUDA-graph
    capture too (stream memory operations become batch-mem-op nodes, CUDA >= 11.7); torch's own
    async-TP switches to a ``memset32`` node there, but for its local flags only, and a memset
    node writing another GPU's memory is what we would rather not rely on. Not yet verified on
    the GPU machines (see templates/p2p_ring/kernels.py)."""
    if flags.dtype != torch.uint32 or flags.dim() != 1:
        raise ValueError(f"write_value32: flags must be a 1-D uint32 tensor, got {flags.dtype} {tuple(flags.shape)}")
    if not 0 <= index < flags.numel():
        raise ValueError(f"write_value32: index {index} outside flags of {flags.numel()} entries")
    torch.ops.symm_mem.stream_write_value32_(flags, index, int(value))
