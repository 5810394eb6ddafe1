"""p2p_ring on NVIDIA GPUs with transport "p2p": copy-engine peer copies between symmetric
buffers (no SMs taken from the GEMM), cuBLAS GEMM pieces, readiness through a READY / BUSY flag
pair per peer and buffer (runtime.peer_flags, back at 0 after every call). Row stripes only
(``outer == 1``), one direction; ``slices`` cut RS / A2A messages into row slices. A copy's flag
writes follow it: a BUSY write queued ahead would delay its start.

Every buffer a rank receives into has W-1 slots, one per peer (``_slot``: none for the rank itself).
The all-gathers, reduce-scatters and all-to-alls of a group share one, grown to the largest call
(mailbox.py): a message waits for the peer to be done with my previous one, whichever call sent it.

All-gather -> GEMMs (push straight from the shard into each peer's inbox [W-1, rows, K], one slot per sender)::

    copy stream   wait BUSY[d] == 0 for every destination d (d done with my slot since my last message)
                  for d = r+1, r+2, ...: peer(d).inbox[me] <- shard (copy engine); BUSY[d] = 1;
                  READY[me] = 1 on d; then gathered[rows of r] <- shard
    compute       y[rows of r] = shard @ b; for s = 1..W-1: src = ag_source(r, s): wait READY[src];
                  y[rows of src] = inbox[src] @ b, while the copy stream copies inbox[src] into
                  gathered[rows of src]; once both are done, BUSY[me] = 0 on src

The copies into ``gathered`` are left out where ``plan.gathered`` is false; no ``slices`` here.

GEMM -> reduce-scatter (push partials to the owner, sum in fp32 as they arrive)::

    copy stream   wait BUSY[d] == 0 for every d (owners done summing my last partials)
                  for step j < W-1: d = rs_stripe(r, j): wait event_j;
                                    peer(d).slot[me] <- partial_j (copy engine); BUSY[d] = 1; READY[me] = 1 on d
    compute       partial_j = a[stripe d] @ b (+ bias) for j = 0..W-2; then for j = 0..W-3:
                  wait READY[r + j + 1], acc (fp32) += slot[r + j + 1], BUSY[me] = 0 on r + j + 1;
                  my own stripe's GEMM; the last arrival; out = (acc + own + last) (/ W) in one
                  pass (sum_kernel.py), in the dtype

GEMM -> all-reduce: the reduce-scatter above over W row stripes of the output, then the
all-gather above of the reduced stripes (no GEMM); with ``"chunks": c`` in two phases so chunk
i's gather travels while chunk i+1's GEMM runs (run_allreduce).

GEMM -> all-to-all (push blocks to their destination)::

    copy stream   wait BUSY[dst] == 0 for every dst; for s: (dst, src) = a2a_pair(r, s):
                  wait event_s; peer(dst).slot[me] <- block_s; BUSY[dst] = 1; READY[me] = 1 on dst
    compute       block_s = a[stripe dst] @ b for s = 1..W-1; my own block straight into out;
                  then for every src: wait READY[src]; out[rows of src] <- slot[src];
                  BUSY[me] = 0 on src

Cross-rank waits never run on the copy stream while a GEMM holds every SM (a waiting kernel needs
an SM slot). The whole op is stream work, capturable in a CUDA graph.

What the copy stream reads stays referenced until the call's join (inputs, outputs, the partials
of ``_push_all``): templates/base.py, streams and the caching allocator.
"""
from __future__ import annotations

import dataclasses

import torch

from ...runtime import comm, peer_flags, spin_wait, symm
from ...runtime.peer_flags import on_stream
from ..plans import AllGatherGemmPlan, GemmCollectivePlan, allreduce_chunks, allreduce_gather, allreduce_stripes
from .reference import a2a_pair, ag_source, bounds, check_config, rs_stripe
from . import mailbox
from .sum_kernel import sum_into

TEMPLATE = "p2p_ring"
# the all-reduce's buffers: it holds a reduce-scatter's and an all-gather's messages at once, so it
# cannot share the group's mailbox (one message per peer at a time)
ALLREDUCE = "/allreduce"


# Timeouts of its flag waits (runtime.peer_flags names the template and the wait).
SignalTimeoutError = peer_flags.PeerWaitTimeoutError


# ---- where to run ----------------------------------------------------------------------------

def usable(group_name: str, device: torch.device, plan=None) -> str | None:
    """Why the copy-engine path cannot run this plan here (None: it can); without a plan, whether
    it can run on this group and device at all."""
    if plan is not None and plan.config.get("transport") != "p2p":
        return "the plan's transport is not 'p2p'"
    if plan is not None and plan.outer != 1:
        return "the copy-engine path moves whole row stripes (scatter / gather along dim 0 only)"
    if not spin_wait.HAVE_TRITON:
        return "the bounded waits need Triton"
    return symm.usable(group_name, device)


# ---- streams, flags, errors (runtime.peer_flags) ------------------------------------------------

copy_stream = peer_flags.copy_stream


def _tag(text: str) -> int:
    return peer_flags.tag(f"{TEMPLATE}: {text}")


def check_errors(device: torch.device | int | None = None, synchronize: bool = True) -> None:
    """Raise SignalTimeoutError if a bounded flag wait failed on ``device``."""
    peer_flags.check_errors(device, synchronize)


def _Flags(group_name: str, key: str, world: int, device: torch.device, timeout_ms: int,
           what: str) -> peer_flags.PeerFlags:
    return peer_flags.flags(TEMPLATE, group_name, key, world, device, timeout_ms, what)


def _mine(buf: mailbox.Mailbox, sender: int) -> torch.Tensor:
    """The slot of my buffer that ``sender`` writes into."""
    return buf.slot(buf.rank, sender)


def _theirs(buf: mailbox.Mailbox, owner: int) -> torch.Tensor:
    """My slot in ``owner``'s buffer (mapped into my address space)."""
    return buf.slot(owner, buf.rank)


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    if bias is None:
        return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)
    return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)


def _start(device: torch.device, plan) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Raise a failure recorded by an earlier call; fork the copy stream off the caller's stream
    (inputs ready; under capture this brings the copy stream into the graph)."""
    check_errors(device, synchronize=False)
    check_config(plan.kind if isinstance(plan, GemmCollectivePlan) else "allgather_gemm", plan.config)
    compute, copier = torch.cuda.current_stream(device), copy_stream(device)
    copier.wait_stream(compute)
    return compute, copier


# ---- all-gather -> GEMMs -----------------------------------------------------------------------

def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                  group_name: str, plan: AllGatherGemmPlan,
                  outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Returns ``[gathered, y_0, y_1, ...]`` like reference.run_allgather (into ``outs`` when
    given). Each rank pushes its shard straight from where it lies into its slot of every peer's
    inbox: no staging copy, no meeting before the first GEMM (the module doc)."""
    gathered, *ys = outs if outs is not None else _new_outputs(shard, plan)
    gather = _gather_start(shard, group_name, plan, gathered)
    r, rows = gather.r, plan.chunk
    for b, bias, y in zip(bs, biases, ys):  # my own shard's rows: nothing to wait for
        _gemm(gather.shard, b, bias, out=y[r * rows:(r + 1) * rows])
    _gather_finish(gather, bs, biases, ys)
    gather.compute.wait_stream(gather.copier)
    return [gathered] + ys


@dataclasses.dataclass
class _Gather:
    """An all-gather under way (``_gather_start`` -> ``_gather_finish``)."""

    shard: torch.Tensor
    gathered: torch.Tensor | None  # None: not written (plan.gathered)
    inbox: mailbox.Mailbox
    flags: peer_flags.PeerFlags
    r: int
    rows: int
    sources: list[int]
    compute: torch.cuda.Stream
    copier: torch.cuda.Stream


def _gather_flags(group_name: str, plan: AllGatherGemmPlan, dtype: torch.dtype, device: torch.device,
                  key: str | None = None) -> tuple[mailbox.Mailbox, peer_flags.PeerFlags]:
    """The inbox and its flags: the group's mailbox (key None), or the all-reduce's own buffer."""
    return _receive_buffer(group_name, "allgather", plan.world, plan.chunk, plan.k, dtype, device, plan.timeout_ms,
                           key, "all-gather")


def _receive_buffer(group_name: str, kind: str, w: int, rows: int, cols: int, dtype: torch.dtype,
                    device: torch.device, timeout_ms: int, key: str | None, what: str):
    """W-1 slots of [rows, cols] and the flags that guard them: the group's mailbox (key None: one
    message per peer at a time, whatever its kind), or a box of ``kind + key``'s own."""
    box = mailbox.mailbox(group_name, w, rows, cols, dtype, device, "mailbox" if key is None else f"{kind}{key}")
    return box, _Flags(group_name, box.key, w, device, timeout_ms, what)


def _gather_dests(r: int, w: int) -> list[int]:
    """Where rank r's shard goes, in order: who computes my rows first comes first."""
    return [ag_source(r, w, -s) for s in range(1, w)]


def _scatter_dests(r: int, w: int) -> list[int]:
    """The owners of the stripes rank r's reduce-scatter pushes partials to, in push order."""
    return [rs_stripe(r, w, j) for j in range(w - 1)]


def _gather_start(shard: torch.Tensor, group_name: str, plan: AllGatherGemmPlan, gathered: torch.Tensor,
                  key: str | None = None, claimed: bool = False) -> _Gather:
    """Push ``shard`` into every peer's inbox on the copy stream and copy it into its rows of
    ``gathered``. ``claimed``: the caller already waited for the peers' slots (_claim)."""
    w, rows, dev = plan.world, plan.chunk, shard.device
    shard = shard.contiguous()
    inbox, flags = _gather_flags(group_name, plan, shard.dtype, dev, key)
    r = inbox.rank
    compute, copier = _start(dev, plan)
    dests = _gather_dests(r, w)
    if not claimed:
        # Each destination done with my slot since its last message from me: waited on the copy
        # stream, queued before this call's first GEMM (a wait kernel queued behind a running GEMM
        # might find no SM slot), so my own shard's GEMM does not wait for a slower peer
        with on_stream(copier, compute):
            for d in dests:
                flags.wait_free(d)
    with on_stream(copier, compute):  # copy engine: no SM taken from the GEMMs
        for d in dests:  # BUSY after the copy, before READY: the copy is the queue's first piece
            _theirs(inbox, d).copy_(shard)
            flags.busy(d)
            flags.ready(d)
        mine = gathered[r * rows:(r + 1) * rows]
        # an all-reduce's chunk sums straight into its rows; a graph that reads only the GEMMs'
        # outputs gets no gathered matrix (plan.gathered, passes/rewrite.py)
        if plan.gathered and mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
    return _Gather(shard, gathered if plan.gathered else None, inbox, flags, r, rows,
                   [ag_source(r, w, s) for s in range(1, w)], compute, copier)


def _gather_finish(g: _Gather, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                   ys: list[torch.Tensor]) -> None:
    """Each peer's shard, once landed: its GEMMs on the compute stream, its copy into ``gathered``
    on the copy stream; then the slot goes back to its owner."""
    rows = g.rows
    for step, src in enumerate(g.sources, start=1):
        g.flags.wait_ready(src, step)  # on the compute stream, between GEMMs: the SMs are free
        piece = _mine(g.inbox, src)
        if g.gathered is not None:
            landed = torch.cuda.Event()
            landed.record(g.compute)
            with on_stream(g.copier, g.compute):  # into the gathered output beside the GEMMs
                g.copier.wait_event(landed)
                g.gathered[src * rows:(src + 1) * rows].copy_(piece)
        for b, bias, y in zip(bs, biases, ys):
            _gemm(piece, b, bias, out=y[src * rows:(src + 1) * rows])
        read = torch.cuda.Event()
        read.record(g.compute)
        with on_stream(g.copier, g.compute):  # slot read by the GEMMs and copied out: src may refill it
            g.copier.wait_event(read)
            g.flags.release(src)


def _new_outputs(shard: torch.Tensor, plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    return [shard.new_empty(plan.m, plan.k)] + [shard.new_empty(plan.m, n) for n in plan.ns]


# ---- GEMM -> reduce-scatter / all-to-all / all-reduce ----------------------------------------------

def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """The site's result rows (reference.out_shape), written into ``out`` when given."""
    if plan.kind == "gemm_reducescatter":
        return run_reducescatter(a, b, bias, group_name, plan, out)
    if plan.kind == "gemm_alltoall":
        return run_alltoall(a, b, bias, group_name, plan, out)
    if plan.kind == "gemm_allreduce":
        return run_allreduce(a, b, bias, group_name, plan, out)
    raise ValueError(f"{TEMPLATE}: the copy-engine path implements gemm_reducescatter, gemm_alltoall and "
                     f"gemm_allreduce, not {plan.kind!r}")


def run_allreduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                  plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reduce-scatter over W row stripes of the output, then the all-gather (copy-engine
    pushes, no GEMM) of the reduced stripes: ``[m, n]`` on every rank (reference.allreduce_*).

    With ``"chunks": c`` the rows are cut into c chunks, each with its own stripes, buffers and
    flags (every wait for the peers' slots runs before the first GEMM, _claim)::

        phase 1  for chunk i: the peers' stripes' GEMMs, each partial pushed once computed
        phase 2  for chunk i: my stripe's GEMM plus the peers' partials of chunk i, into ``out``;
                 its reduced rows pushed to every peer; chunk i-1's reduced stripes copied out

    so only the last chunk's reduced stripes trail the GEMMs."""
    a = a.contiguous()
    out = a.new_empty(plan.m, plan.n) if out is None else out
    chunks = allreduce_chunks(plan)
    if len(chunks) == 1:  # run_reducescatter checks the reduce op
        _claim(a, group_name, [plan], [ALLREDUCE])
        r, rows = comm.rank_and_size(group_name)[0], plan.m // plan.world
        mine = run_reducescatter(a, b, bias, group_name, allreduce_stripes(plan), out=out[r * rows:(r + 1) * rows],
                                 claimed=True, key=ALLREDUCE)  # summed straight into its rows
        gather = _gather_start(mine, group_name, allreduce_gather(plan), out, key=ALLREDUCE, claimed=True)
        _gather_finish(gather, [], [], [])
        gather.compute.wait_stream(gather.copier)
        return out
    _check_reduce_op(plan)
    keys = [f"{ALLREDUCE}/c{i}" for i in range(len(chunks))]
    _claim(a, group_name, [sub for _, _, sub in chunks], keys)
    r = comm.rank_and_size(group_name)[0]
    dests = _scatter_dests(r, plan.world)
    stripes = [allreduce_stripes(sub) for _, _, sub in chunks]
    # every chunk's partials pushed first: chunk by chunk, the copy queue tied a chunk's partials
    # to the previous chunk's sum (it ran slower than the unchunked op)
    pushed = [_push_all(a[lo:hi], b, bias, group_name, st, key, "gemm_reducescatter", dests,
                        claimed=True)
              for (lo, hi, _), st, key in zip(chunks, stripes, keys)]
    pending = None
    for (lo, hi, sub), st, key, push in zip(chunks, stripes, keys, pushed):
        mine = slice(lo + r * st.chunk, lo + (r + 1) * st.chunk)  # my reduced rows of this chunk
        _reduce_own(a[mine], b, bias, st, push, out[mine], fused=True, join=False)
        gather = _gather_start(out[mine], group_name, allreduce_gather(sub), out[lo:hi], key=key, claimed=True)
        if pending is not None:  # the previous chunk's reduced stripes, landed while this GEMM ran
            _gather_finish(pending, [], [], [])
        pending = gather
    _gather_finish(pending, [], [], [])
    pending.compute.wait_stream(pending.copier)
    return out


def _claim(a: torch.Tensor, group_name: str, plans: list[GemmCollectivePlan], keys: list[str]) -> None:
    """Before any GEMM of an all-reduce: wait until every peer is done with my slots of every
    chunk's reduce-scatter and gather buffers since my last call (on the compute stream: a wait
    kernel queued behind a running GEMM might find no SM slot); the copy stream then follows."""
    dev, r = a.device, comm.rank_and_size(group_name)[0]
    for sub, key in zip(plans, keys):
        rs = allreduce_stripes(sub)
        _, rs_flags = _push_flags(group_name, rs, key, "gemm_reducescatter", a.dtype, dev)
        for d in _scatter_dests(r, sub.world):
            rs_flags.wait_free(d)
        _, ag_flags = _gather_flags(group_name, allreduce_gather(sub), a.dtype, dev, key)
        for d in _gather_dests(r, sub.world):
            ag_flags.wait_free(d)
    peer_flags.copy_stream(dev).wait_stream(torch.cuda.current_stream(dev))


def _push_flags(group_name: str, plan, key: str | None, what: str, dtype: torch.dtype,
                device: torch.device) -> tuple[mailbox.Mailbox, peer_flags.PeerFlags]:
    # a key names the all-reduce's reduce-scatter buffers; every other push receives into the mailbox
    return _receive_buffer(group_name, "reducescatter", plan.world, plan.chunk, plan.n, dtype, device,
                           plan.timeout_ms, key, what)


def _push_all(a, b, bias, group_name, plan, key: str | None, what: str, order: list[int], claimed: bool = False):
    """Compute the partial / block for each destination in ``order`` on the compute stream and
    push each into slot ``me`` of its destination's buffer on the copy stream. Returns the data
    buffer, the flags, the streams, the rank and the partials, which the caller holds until its
    join (the module doc); the caller computes its own piece and collects.
    ``claimed``: the caller already waited for the destinations' slots (_claim)."""
    rows, dev = plan.chunk, a.device
    data, flags = _push_flags(group_name, plan, key, what, a.dtype, dev)
    r = data.rank
    compute, copier = _start(dev, plan)
    if not claimed:
        with on_stream(copier, compute):  # before any GEMM of this call holds the SMs
            for d in order:
                flags.wait_free(d)
    # each destination's rows in ``slices`` row slices: a slice leaves while the next is computed;
    # READY once the last one is in place (the receiver sums whole partials)
    parts = bounds(rows, plan.config.get("slices", 1))
    sent = []
    for d in order:
        for i, (lo, hi) in enumerate(parts):
            part = _gemm(a[d * rows + lo:d * rows + hi], b, bias)
            ev = torch.cuda.Event()
            ev.record(compute)
            with on_stream(copier, compute):
                copier.wait_event(ev)
                _theirs(data, d)[lo:hi].copy_(part)
                if i == len(parts) - 1:  # BUSY before READY (the receiver's release follows READY)
                    flags.busy(d)
                    flags.ready(d)
            sent.append(part)
    return data, flags, compute, copier, r, sent


def run_reducescatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                      plan: GemmCollectivePlan, out: torch.Tensor | None = None,
                      claimed: bool = False, key: str | None = None) -> torch.Tensor:
    """Rank r's reduced stripe ``[rows, n]`` of ``a @ b + bias`` summed over ranks (/W for avg).
    ``claimed``: see _push_all; ``key``: see _receive_buffer."""
    _check_reduce_op(plan)
    a = a.contiguous()
    r = comm.rank_and_size(group_name)[0]
    pushed = _push_all(a, b, bias, group_name, plan, key, "gemm_reducescatter", _scatter_dests(r, plan.world),
                       claimed)
    return _reduce_own(a[r * plan.chunk:(r + 1) * plan.chunk], b, bias, plan, pushed, out, fused=False)


def _check_reduce_op(plan: GemmCollectivePlan) -> None:
    if plan.reduce_op not in ("sum", "avg"):
        raise ValueError(f"{TEMPLATE}: reduce op {plan.reduce_op!r} is not supported (supported: ['sum', 'avg'])")


def _reduce_own(own_rows: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, plan: GemmCollectivePlan,
                pushed: tuple, out: torch.Tensor | None, fused: bool, join: bool = True) -> torch.Tensor:
    """My stripe ``own_rows @ b (+ bias)`` summed with the peers' partials in my slots (``pushed``:
    what _push_all returned); into ``out`` when given. ``join``: the compute stream then waits
    for the copy stream (the end of a reduce-scatter; not inside the all-reduce's pipeline).

    ``fused`` (W = 2, no bias): wait for the peer's partial first, then one GEMM adds it in its
    epilogue (addmm with the partial as C): no separate sum pass. Right only where the partial has
    landed by then (the all-reduce's chunk pipeline pushed it a whole phase earlier); otherwise my
    own GEMM runs first and the partials are summed after it (a wait between GEMMs would stall
    them behind a slow peer), the first W-2 while nothing else is queued, the last one after my
    own GEMM, in one pass (sum_kernel.py: this tail is what the GEMMs cannot hide)."""
    data, flags, compute, copier, r, _ = pushed  # the caller holds the partials until the join
    w = plan.world
    scale = 1.0 / w if plan.reduce_op == "avg" else 1.0
    last = (r + w - 1) % w
    if fused and w == 2 and bias is None:
        flags.wait_ready(last, 0)
        out = torch.addmm(_mine(data, last), own_rows, b, beta=scale, alpha=scale, out=out)
    else:
        acc = None
        # The partial rank r + j + 1 pushes at its step j is for me.
        for j in range(w - 2):
            acc = _accumulate(acc, data, flags, (r + j + 1) % w, j)
        # into ``out`` itself where given: the sum reads and writes each element once, in place, and
        # a temporary stripe would sit beside the op's output until the call returns
        own = _gemm(own_rows, b, bias, out=out)
        flags.wait_ready(last, w - 2)
        out = sum_into(own, own, _mine(data, last), acc, scale)
    flags.release(last)
    if join:
        compute.wait_stream(copier)
    return out


def _accumulate(acc, data, flags: _Flags, src: int, step: int) -> torch.Tensor:
    """acc (fp32) += the partial ``src`` pushed into my slot ``src``; then free that slot."""
    flags.wait_ready(src, step)
    slot = _mine(data, src)
    # a copy even when the slot is fp32 already: the slot is released below and a peer's next
    # call may overwrite it while acc is still being summed into
    acc = slot.to(torch.float32, copy=True) if acc is None else acc.add_(slot)
    flags.release(src)
    return acc


def run_alltoall(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                 plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block j of the result (rows j*rows..) is source j's ``a @ b + bias`` rows of my stripe."""
    w, rows = plan.world, plan.chunk
    a = a.contiguous()
    r = comm.rank_and_size(group_name)[0]
    pairs = [a2a_pair(r, w, s) for s in range(1, w)]
    data, flags, compute, copier, r, sent = _push_all(a, b, bias, group_name, plan, None, "gemm_alltoall",
                                                [dst for dst, _ in pairs])
    out = a.new_empty(plan.m, plan.n) if out is None else out
    _gemm(a[r * rows:(r + 1) * rows], b, bias, out=out[r * rows:(r + 1) * rows])  # stays here, computed last
    for s, (_, src) in enumerate(pairs, start=1):
        flags.wait_ready(src, s)
        out[src * rows:(src + 1) * rows].copy_(_mine(data, src))
        flags.release(src)
    compute.wait_stream(copier)
    del sent  # the partials, held until the join (templates/base.py: no record_stream)
    return out
