"""One receive buffer per (group, kind, dtype, device) for p2p_ring's all-gathers,
reduce-scatters and all-to-alls, grown to the largest call of its kind, with one READY / BUSY
flag set guarding it (runtime.peer_flags).

    box = mailbox(group_name, "allgather", world, rows, cols, dtype, device)
    box.local[slot]            # [rows, cols]: slot ``slot`` of my buffer, the first rows x cols
    box.peer(q)[slot]          #   elements of a row of W-1 x capacity; the same on rank q
    box.key                    # the flags' key: calls sharing the memory share the flags

Each (sender, receiver) pair owns one slot, and a sender waits on BUSY until the receiver has
read its previous message of that kind. Sites of one kind with different row counts (the
buckets of a symbolic site, every prefill length a server sees) share the buffer: a buffer per
shape would grow with every new length. The kinds keep buffers apart: an all-gather then waits
only for the peer to have read the previous all-gather's shard (long done), not the reduce-scatter
just before it, which would hold its own shard's GEMM for a slower peer. The all-reduce keeps
buffers of its own (it holds a reduce-scatter's and an all-gather's messages at once, kernels._claim).

A call that needs more than the buffer holds makes a larger one, with fresh flags, that later
calls use (runtime.symm.grown_buffer: the smaller is kept for the CUDA graphs that captured it).
"""
from __future__ import annotations

import dataclasses

import torch

from ...runtime import symm

TEMPLATE = "p2p_ring"
KINDS = ("allgather", "reducescatter", "alltoall")


@dataclasses.dataclass
class Mailbox:
    """A [W-1, rows, cols] face over a symmetric buffer of W-1 slots of ``capacity`` elements.
    Views are taken at each access: under testing.virtual_ranks the buffer's rank changes by thread."""

    buf: symm.SymmBuffer
    rows: int
    cols: int
    key: str

    @property
    def rank(self) -> int:
        return self.buf.rank

    @property
    def world(self) -> int:
        return self.buf.world

    @property
    def local(self) -> torch.Tensor:
        return self._face(self.buf.local)

    def peer(self, rank: int) -> torch.Tensor:
        return self._face(self.buf.peer(rank))

    def _face(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, :self.rows * self.cols].unflatten(1, (self.rows, self.cols))


def mailbox(group_name: str, kind: str, world: int, rows: int, cols: int, dtype: torch.dtype,
            device: torch.device) -> Mailbox:
    """The group's receive buffer for ``kind``, grown to hold ``rows x cols`` per slot if it does not."""
    if kind not in KINDS:
        raise ValueError(f"{TEMPLATE} mailbox: kind {kind!r} is not one of {list(KINDS)}")
    if world < 2 or rows < 0 or cols < 0:
        raise ValueError(f"{TEMPLATE} mailbox: needs a world size >= 2 and sizes >= 0, got world {world}, "
                         f"rows {rows}, cols {cols}")
    buf = symm.grown_buffer(group_name, f"{TEMPLATE}/{kind}/mailbox", (world - 1,), rows * cols, dtype, device)
    # the flags go with the memory: a grown buffer starts with fresh ones
    return Mailbox(buf, rows, cols, f"{kind}/mailbox/{world}x{buf.local.shape[-1]}/{dtype}")
