"""One receive buffer per (group, dtype, device) for every all-gather, reduce-scatter and
all-to-all call of p2p_ring, grown to the largest call, with one READY / BUSY flag set guarding it
(runtime.peer_flags).

    box = mailbox(group_name, world, rows, cols, dtype, device)
    box.local[slot]            # [rows, cols]: slot ``slot`` of my buffer, the first rows x cols
    box.peer(q)[slot]          #   elements of a row of W-1 x capacity; the same on rank q
    box.key                    # the flags' key: calls sharing the memory share the flags

Each (sender, receiver) pair owns one slot, and a sender waits on BUSY until the receiver has read
its previous message, whichever call sent it. So an all-gather's inbox and a reduce-scatter's slots
are the same memory (one buffer where a block's sites held two), and so are the sites of one kind
with different row counts (a symbolic site's every length: a buffer per shape grew with each new
one). The all-reduce keeps buffers of its own (it holds a reduce-scatter's and an all-gather's
messages at once, kernels._claim).

A call that needs more than the buffer holds makes a larger one, with fresh flags, that later
calls use (runtime.symm.grown_buffer: the smaller is kept for the CUDA graphs that captured it).
"""
from __future__ import annotations

import dataclasses

import torch

from ...runtime import symm

TEMPLATE = "p2p_ring"


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
        return symm.face(t, (self.rows, self.cols))


def mailbox(group_name: str, world: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Mailbox:
    """The group's receive buffer, grown to hold ``rows x cols`` per slot if it does not."""
    if world < 2 or rows < 0 or cols < 0:
        raise ValueError(f"{TEMPLATE} mailbox: needs a world size >= 2 and sizes >= 0, got world {world}, "
                         f"rows {rows}, cols {cols}")
    buf = symm.grown_buffer(group_name, f"{TEMPLATE}/mailbox", (world - 1,), rows * cols, dtype, device)
    # the flags go with the memory: a grown buffer starts with fresh ones
    return Mailbox(buf, rows, cols, f"mailbox/{world}x{buf.local.shape[-1]}/{dtype}")
