"""Symmetric-memory buffers for templates that move data between GPUs without NCCL (peer copies
on the copy engine, or Triton kernels reading / writing peers' memory over NVLink).

    buf = symm_buffer(group_name, "p2p_ring.ag", (rows, k), dtype, device)
    buf.local                      # my buffer: peers read / write it
    buf.peer(rank)                 # a tensor on my device mapping that rank's buffer
    buf.ptrs                       # int64 device table: every rank's address of the buffer
    buf.barrier(channel, timeout)  # every rank of the group reached this point in stream order

    t, ptrs = tensor_and_ptrs(group_name, key, shape, dtype, device, zero=False)   # kernels' form
    peer_view(group_name, t, rank)                                                  # by tensor

A buffer is allocated once per (group, key, shape, dtype, device) and reused by every call:
allocation and rendezvous are collective (every rank must ask for the same buffers in the same
order) and slow, and must not happen inside a CUDA-graph capture (refused with a clear error).
Buffers and rendezvous handles live for the life of the process: a peer view outlives nothing it
depends on (the profile run on 4x H200 showed a peer copy failing with "invalid argument" once
the local buffer behind the handle had been freed).

On torch 2.11+ ``buffer_ptrs`` are the allocation bases: a tensor's address on rank q is
``buffer_ptrs[q] + (t.data_ptr() - buffer_ptrs[rank])`` (DESIGN.md), and peer views take the same
offset. ``usable(group_name, device)`` says why this transport cannot run (None when it can).
Importing this module touches neither CUDA nor a process group.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import threading
from typing import Any

import torch


@dataclasses.dataclass
class SymmBuffer:
    local: torch.Tensor
    handle: Any
    rank: int
    world: int
    offset: int          # bytes from the allocation base to ``local`` (same on every rank)
    ptrs: torch.Tensor   # int64 [world] on the device: every rank's address of this buffer
    _peers: dict = dataclasses.field(default_factory=dict)

    def peer(self, rank: int) -> torch.Tensor:
        """``rank``'s buffer, mapped into this device's address space (same shape and dtype)."""
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
_lock = threading.Lock()


def usable(group_name: str, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "symmetric memory needs CUDA tensors"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "this torch has no symmetric memory"
    from .comm import resolve_group

    world, here = resolve_group(group_name).size(), torch.cuda.device_count()
    if world > here:
        return f"the group's {world} ranks are not all on this node ({here} GPUs here)"
    blocked = [(i, j) for i in range(world) for j in range(world) if i != j and not torch.cuda.can_device_access_peer(i, j)]
    if blocked:
        return f"no peer access between GPUs {blocked[0]}"
    return None


def available(group_name: str, device: torch.device) -> bool:
    return usable(group_name, device) is None


def symm_buffer(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                zero: bool = False) -> SymmBuffer:
    """The cached buffer for (group, key, shape, dtype, device); created on first use (collective).
    ``zero``: zeroed on every rank before any peer can write into it (signal pads, counters)."""
    ck = (group_name, key, tuple(shape), dtype, device.index)
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
        try:
            enable(group_name)
        except Exception:
            pass
    local = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
    if zero:
        local.zero_()
        torch.cuda.synchronize(device)  # zeroed before the rendezvous lets any peer see it
    handle = symm_mem.rendezvous(local, group_name)
    from .comm import rank_and_size

    offset = local.data_ptr() - handle.buffer_ptrs[rank_and_size(group_name)[0]]
    ptrs = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
    from .comm import resolve_group

    pg = resolve_group(group_name)
    buf = SymmBuffer(local, handle, pg.rank(), pg.size(), offset, ptrs)
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
