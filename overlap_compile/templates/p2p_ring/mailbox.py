"""One receive buffer per (group, dtype, device) for every all-gather, reduce-scatter and
all-to-all call of p2p_ring, grown to the largest call, with one READY / BUSY flag set guarding it
(runtime.peer_flags).

    box = mailbox(group_name, world, rows, cols, dtype, device)
    box.local[slot]            # [rows, cols]: slot ``slot`` of my buffer, the first rows x cols
    box.peer(q)[slot]          #   elements of a row of W-1 x capacity; the same on rank q
    box.slot(owner, sender)    # sender's slot in owner's buffer (slot_of), mapped here
    box.key                    # the flags' key: calls sharing the memory share the flags

Each (sender, receiver) pair owns one slot, and a sender waits on BUSY until the receiver has read
its previous message, whichever call sent it. So an all-gather's inbox and a reduce-scatter's slots
are the same memory (one buffer where a block's sites held two), and so are the sites of one kind
with different row counts (a symbolic site's every length: a buffer per shape grew with each new
one). The all-reduce keeps boxes of its own, by name (it holds a reduce-scatter's and an
all-gather's messages at once, kernels._claim), grown the same way.

A call that needs more than the buffer holds makes a larger one, with fresh flags, that later
calls use (runtime.symm.grown_buffer: the smaller is kept for the CUDA graphs that captured it).
"""
from __future__ import annotations

import weakref

import torch

from ...runtime import symm

TEMPLATE = "p2p_ring"


class Mailbox:
    """A [W-1, rows, cols] face over a symmetric buffer of W-1 slots of ``capacity`` elements: one
    per (rows, cols, rank), kept in the buffer's memo, so a call's views are taken once (a
    host-launched op asks at every call). A weak reference back to the buffer: no cycle, the
    buffer's memory goes as soon as it is dropped."""

    def __init__(self, buf: symm.SymmBuffer, rows: int, cols: int, key: str) -> None:
        self._buf = weakref.ref(buf)
        self.rows, self.cols, self.key = rows, cols, key
        self.rank, self.world = buf.rank, buf.world
        self.local = symm.face(buf.local, (rows, cols))
        self._peers: dict[int, torch.Tensor] = {}
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def buf(self) -> symm.SymmBuffer:
        return self._buf()

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s buffer, mapped here, in this face."""
        v = self._peers.get(rank)
        if v is None:
            v = self._peers[rank] = self.local if rank == self.rank else symm.face(self.buf.peer(rank),
                                                                                  (self.rows, self.cols))
        return v

    def slot(self, owner: int, sender: int) -> torch.Tensor:
        """[rows, cols]: where ``sender``'s message lies in ``owner``'s buffer, mapped here."""
        v = self._slots.get((owner, sender))
        if v is None:
            v = self._slots[(owner, sender)] = self.peer(owner)[slot_of(owner, sender, self.world)]
        return v


def slot_of(owner: int, sender: int, world: int) -> int:
    """Where ``sender``'s message lies in ``owner``'s buffer of W-1 slots: the peers in ring order
    after the owner (a rank sends itself nothing, so a slot for it would be memory for nothing)."""
    if sender == owner or not (0 <= sender < world and 0 <= owner < world):
        raise ValueError(f"{TEMPLATE}: no slot for rank {sender} in rank {owner}'s buffer (world size {world})")
    return (sender - owner - 1) % world


def mailbox(group_name: str, world: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
            name: str = "mailbox") -> Mailbox:
    """The group's receive buffer ``name``, grown to hold ``rows x cols`` per slot if it does not
    (the all-reduce asks for its own by name)."""
    if world < 2 or rows < 0 or cols < 0:
        raise ValueError(f"{TEMPLATE} mailbox: needs a world size >= 2 and sizes >= 0, got world {world}, "
                         f"rows {rows}, cols {cols}")
    buf = symm.grown_buffer(group_name, f"{TEMPLATE}/{name}", (world - 1,), rows * cols, dtype, device)
    # the flags go with the memory: a grown buffer starts with fresh ones
    return symm.memoized(buf, ("Mailbox", rows, cols, buf.rank),
                         lambda: Mailbox(buf, rows, cols, f"{name}/{world}x{buf.local.shape[-1]}/{dtype}"))
