"""Cross-rank readiness flags of the copy-engine paths (p2p_ring, moe_fused).

Each rank owns a uint32 flag buffer of 2W entries in symmetric memory (runtime.symm)::

    READY[q]   (q's data for me is in place)     written 1 by q, consumed (-> 0) by my wait
    BUSY[q]    (q still has to read / sum the     written 1 by me when I publish, 0 by q once it
               data I gave it)                    is done with it; I wait for 0 before reuse

Flags are written with ``cuStreamWriteValue32`` (symm.write_value32: stream order, fenced, no
kernel, also under graph capture) and waited on with runtime.spin_wait's bounded one-thread
kernel. A wait that runs past its bound records a tag naming the template and what it waited
for; ``check_errors`` raises it at the next call or after a synchronisation. Every flag is back
at 0 once all ranks have finished a call, so calls (and CUDA-graph replays) need no memset.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from . import spin_wait, symm

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
_tags: dict[str, int] = {}
_tag_text: dict[int, str] = {}


class PeerWaitTimeoutError(RuntimeError):
    """A bounded wait on a peer's flag ran past signal_timeout_ms (or saw an impossible value)."""


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This device's stream for peer copies and flag writes. High priority: the wait kernels
    queued on it must get an SM slot ahead of the GEMM's next CTAs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        s = _streams.get(index)
        if s is None:
            _, greatest = torch.cuda.Stream.priority_range()
            s = _streams[index] = torch.cuda.Stream(device=index, priority=greatest)
        return s


class on_stream:
    """``with on_stream(stream, back):`` queues the block's work on ``stream``, then makes ``back``
    (the caller's current stream) current again. What ``torch.cuda.stream`` does, without its
    device bookkeeping: a host-launched op switches streams several times per call, a few
    microseconds each that way. Streams of another device than the current one take
    ``torch.cuda.stream``'s path, which also switches the device and back."""

    __slots__ = ("stream", "back", "_other")

    def __init__(self, stream: torch.cuda.Stream, back: torch.cuda.Stream) -> None:
        self.stream, self.back = stream, back
        self._other = None if stream.device_index == torch.cuda.current_device() else torch.cuda.stream(stream)

    def __enter__(self) -> torch.cuda.Stream:
        if self._other is not None:
            return self._other.__enter__()
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self._other is not None:
            self._other.__exit__(*exc)
            return
        torch.cuda.set_stream(self.back)


def tag(text: str) -> int:
    """A small integer standing for a wait's description (the kernel records the integer)."""
    with _lock:
        t = _tags.get(text)
        if t is None:
            t = _tags[text] = len(_tags) + 1
            _tag_text[t] = text
        return t


def describe(t: int) -> str:
    return _tag_text.get(t, f"wait #{t}")


def check_errors(device: torch.device | int | None = None, synchronize: bool = True,
                 error: type[Exception] = PeerWaitTimeoutError) -> None:
    """Raise ``error`` if a bounded flag wait failed on ``device`` (after a synchronisation
    unless ``synchronize=False``); the message starts with the failed wait's description."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    rec = spin_wait.failure(device, synchronize)
    if rec is None:
        return
    t, seen, target = rec
    spin_wait.clear(device)
    raise error(
        f"{describe(t)}: the flag read {seen}, expected {target} within signal_timeout_ms "
        f"(device cuda:{device.index}); a peer is not running the same plan or has failed. The results of "
        f"that call are invalid.")


def flags(template: str, group_name: str, key: str, world: int, device: torch.device, timeout_ms: int,
          what: str) -> "PeerFlags":
    """The flag buffer of (``template``, ``key``) and the view of it kept on it: one per description,
    bound and rank, made on first use. A host-launched op asks at every call, so what a call needs
    (the peers' mappings, the waits' tags) is worked out once; the view goes with the buffer."""
    buf = symm.symm_buffer(group_name, f"{template}/{key}/flags", (2 * world,), torch.uint32, device, zero=True)
    return symm.memoized(buf, ("PeerFlags", template, what, timeout_ms, buf.rank),
                         lambda: PeerFlags(template, buf, world, timeout_ms, what))


class PeerFlags:
    """One view of a flag buffer ``buf`` (runtime.symm): READY at [0, W), BUSY at [W, 2W).
    ``template`` and ``what`` name the waits in timeout messages. Made by ``flags``; it holds the
    buffer's tensors and only a weak reference to the buffer, which keeps it in its memo: no
    cycle, so a dropped buffer's memory goes at once."""

    def __init__(self, template: str, buf, world: int, timeout_ms: int, what: str):
        self._buf = weakref.ref(buf)
        self.template = template
        self.rank, self.world, self.timeout_ms, self.what = buf.rank, world, timeout_ms, what
        self._local = buf.local
        self._mapped = [buf.peer(q) for q in range(world)]  # every rank's flags, mapped here
        self._counters = buf.local.view(torch.int32)  # what the wait kernel polls (same memory)
        self._tags: dict[tuple, int] = {}

    @property
    def buf(self):
        return self._buf()

    def ready(self, to: int) -> None:
        """READY[me] = 1 on rank ``to`` (after everything queued before on this stream)."""
        symm.write_value32(self._mapped[to], self.rank, 1)

    def busy(self, reader: int) -> None:
        symm.write_value32(self._local, self.world + reader, 1)

    def release(self, owner: int) -> None:
        """Tell ``owner`` I am done with the data it gave me: BUSY[me] = 0 on ``owner``."""
        symm.write_value32(self._mapped[owner], self.world + self.rank, 0)

    def wait_ready(self, src: int, step: int) -> None:
        t = self._tags.get(("ready", src, step))
        if t is None:
            t = self._tags[("ready", src, step)] = tag(
                f"{self.template}: {self.what}, ring step {step}: wait for rank {src}'s data (READY flag {src})")
        spin_wait.wait_value(self._counters, src, 1, self.timeout_ms, t, until_equal=True, sys_scope=True)

    def wait_free(self, reader: int) -> None:
        t = self._tags.get(("free", reader))
        if t is None:
            t = self._tags[("free", reader)] = tag(
                f"{self.template}: {self.what}, call start: wait for rank {reader} to release my buffer "
                f"(BUSY flag {reader})")
        spin_wait.wait_value(self._counters, self.world + reader, 0, self.timeout_ms, t, until_equal=True,
                             sys_scope=True)

    def publish_and_meet(self, peers: list[int], stage: Callable[[], None]) -> None:
        """A pull's call start, on the current stream: wait until every peer released my buffer
        (done pulling my last data), ``stage()`` my data into it, mark it busy for every peer,
        tell them it is ready, and wait until theirs is. Run it before the call's first GEMM:
        a wait kernel queued behind a running GEMM might find no SM slot until that GEMM ends."""
        for q in peers:
            self.wait_free(q)
        stage()
        for q in peers:
            self.busy(q)
        for q in peers:
            self.ready(q)
        for step, src in enumerate(peers, start=1):
            self.wait_ready(src, step)
