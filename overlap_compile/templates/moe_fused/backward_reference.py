"""moe_fused_backward, step by step on any device: the gradient of the expert-parallel SwiGLU
section (passes/find_moe_backward.py) as a pipeline by source. The section as written::

    got   = all_to_all(grad_buf)                      # [W, E_local, C, H]: every source's gradient slots
    g     = got as [E_local, W*C, H]
    d_act = g @ w2t;   d_up = d_act * silu(gate);   d_gate = silu_backward(d_act * up, gate)
    d_h   = d_up @ w3t + d_gate @ w1t
    dw1 = tokens_t @ d_gate;   dw3 = tokens_t @ d_up;   dw2 = act_t @ g
    d_buf = all_to_all(d_h as [W, E_local, C, H])     # back to the sources

Each row of g goes through d_h alone, so the forward's rounds carry it: round r receives source
(rank - r) % W's slots and sends their d_h home at once, the own slots first::

    (own)    | grad piece 1 | grad piece 2 ... | d_h 1 | d_h 2 ...
    d_h own  | d_h 1        | d_h 2 ...        | dw1, dw3, dw2 (all rows, once)

The weight gradients sum over every row, so they run once over the full g, d_gate and d_up (same
GEMMs and order as the section) while the last d_h pieces travel. Operands are what the bmm read.
"""
from __future__ import annotations

import torch

from ...runtime import comm
from ..plans import MoePlan
from . import packed
from . import reference as ref
from .swiglu_kernels import silu_mul_backward


def swiglu_grad(g: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, w1t: torch.Tensor, w3t: torch.Tensor,
                w2t: torch.Tensor, d_gate: torch.Tensor, d_up: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Rows of one piece, ``[E, n, *]``: writes d_gate and d_up (views of the full tensors the
    weight gradients read) and returns d_h ``[E, n, H]`` (into ``out`` when given). The
    formulas are eager autograd's for silu(gate) * up, which the finder's probe compares
    Inductor's decomposition with."""
    d_act = torch.bmm(g, w2t)
    silu_mul_backward(d_act, gate, up, d_gate, d_up)  # one pass (swiglu_kernels.py)
    return torch.bmm(d_up, w3t, out=out).baddbmm_(d_gate, w1t)


class Pieces:
    """One call's work by source, on either transport: ``own()``, ``peer(src, got)`` and
    ``after()`` as reference.exchange_by_source / kernels_nccl.rounds_by_source call them."""

    def __init__(self, slots: torch.Tensor, out: torch.Tensor, rank: int, plan: MoePlan, tokens_t, gate, up,
                 act_t, w1t, w3t, w2t, grads_into: list[torch.Tensor] | None = None):
        """``grads_into``: dw1, dw3, dw2 to write into (backward_op.py hands its outputs over so
        that a replayed call writes where the caller reads); new ones when None."""
        self.world, self.ffn = plan.world, plan.ffn
        self.slots, self.out, self.rank, self.shape = slots, out, rank, (plan.e_local, plan.capacity, plan.hidden)
        self.tokens_t, self.gate, self.up, self.act_t, self.ws = tokens_t, gate, up, act_t, (w1t, w3t, w2t)
        self.grads: list[torch.Tensor] = []
        self.grads_into = grads_into
        self._allocate()

    def _allocate(self) -> None:
        """The full tensors, laid out as the section has them: the weight gradients read them whole."""
        (e, c, h), w, f = self.shape, self.world, self.ffn
        self.g = self.slots.new_empty(e, w * c, h)
        self.d_gate, self.d_up = self.gate.new_empty(e, w * c, f), self.gate.new_empty(e, w * c, f)

    def _rows(self, source: int, got: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        e, c, h = self.shape
        cols = slice(source * c, (source + 1) * c)
        self.g[:, cols] = got.view(e, c, h)
        w1t, w3t, w2t = self.ws
        return swiglu_grad(got.view(e, c, h), self.gate[:, cols], self.up[:, cols], w1t, w3t, w2t,
                           self.d_gate[:, cols], self.d_up[:, cols], out=out)

    def own(self) -> None:
        self._rows(self.rank, self.slots[self.rank], out=self.out[self.rank].view(self.shape))

    def peer(self, src: int, got: torch.Tensor) -> torch.Tensor:
        return self._rows(src, got).view(got.shape[0], -1)

    def after(self) -> None:
        into = self.grads_into or [None, None, None]
        self.grads = [torch.bmm(a, b, out=o) if o is not None else torch.bmm(a, b)
                      for (a, b), o in zip(((self.tokens_t, self.d_gate), (self.tokens_t, self.d_up),
                                            (self.act_t, self.g)), into)]

    def result(self) -> list[torch.Tensor]:
        """[d_buf [W * E * C, H], dw1, dw3, dw2]: what the op returns."""
        return [self.out.view(-1, self.shape[2]), *self.grads]


class PackedPieces(Pieces):
    """Pieces on packed rows (``"experts": "packed"``, packed.py): each piece's gradient rows
    packed by their own sizes for d_act, the elementwise step and d_h; the weight gradients once
    after the last piece, grouped over K at each expert's rows, every source's rows packed expert
    by expert (the saved tokens and act gathered; the pieces' packed gradients re-ordered)."""

    def _allocate(self) -> None:
        """Every source's packed rows, piece after piece, and their sizes: what the weight gradients read."""
        (e, c, h), w, f = self.shape, self.world, self.ffn
        self.g_p = self.slots.new_empty(w, e * c, h)
        self.d_gate_p, self.d_up_p = self.gate.new_empty(w, e * c, f), self.gate.new_empty(w, e * c, f)
        self.sizes = torch.zeros(w, e, dtype=torch.int32, device=self.slots.device)

    def _rows(self, source: int, got: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        e, c, h = self.shape
        g = got.view(e, c, h)
        n, pack, unpack, offs = packed.piece_maps(g)
        self.sizes[source].copy_(n)
        cols = slice(source * c, (source + 1) * c)
        w1t, w3t, w2t = self.ws
        g_p = packed.move_rows(g, pack, out=self.g_p[source])
        d_gate_p, d_up_p = self.d_gate_p[source], self.d_up_p[source]
        # gate and up read where the forward saved them, through the pack index (no gathered copies)
        silu_mul_backward(packed.grouped(g_p, w2t, offs), self.gate[:, cols], self.up[:, cols], d_gate_p, d_up_p,
                          rows=pack)
        d_h = packed.grouped(d_up_p, w3t, offs).add_(packed.grouped(d_gate_p, w1t, offs))
        out = got.new_empty(e, c, h) if out is None else out
        return packed.move_rows(d_h, unpack, out=out.view(e, c, h))

    def after(self) -> None:
        (e, c, _), w = self.shape, self.world
        dev = self.slots.device
        sizes = self.sizes.t()  # [E, W]: expert e's rows from each source, in expert-major order
        # the saved layout [E, W*C, *] is E*W groups of C slots, (expert, source) after another
        from_saved = packed.slot_maps(sizes, c)[0]
        # where each (expert, source) segment begins in the pieces' packed rows [W, E*C, *] (each
        # piece packed expert after expert)
        begins = torch.cumsum(self.sizes.long(), 1) - self.sizes.long()  # [W, E]
        piece_starts = (torch.arange(w, device=dev)[:, None] * (e * c) + begins).t()
        from_pieces = packed.gather_index(sizes, piece_starts, w * e * c)
        offs = packed.group_ends(sizes.sum(1))
        tokens = packed.move_rows(packed.saved_rows(self.tokens_t), from_saved)
        act = packed.move_rows(packed.saved_rows(self.act_t), from_saved)
        g = packed.move_rows(self.g_p, from_pieces)
        d_gate, d_up = packed.move_rows(self.d_gate_p, from_pieces), packed.move_rows(self.d_up_p, from_pieces)
        grads = [packed.grouped(tokens.t(), d_gate, offs), packed.grouped(tokens.t(), d_up, offs),
                 packed.grouped(act.t(), g, offs)]
        into = self.grads_into or [None, None, None]
        self.grads = [o.copy_(t) if o is not None else t for t, o in zip(grads, into)]


def make_pieces(slots: torch.Tensor, out: torch.Tensor, rank: int, plan: MoePlan, *operands,
                grads_into: list[torch.Tensor] | None = None) -> Pieces:
    """The call's Pieces (``operands``: tokens_t, gate, up, act_t, w1t, w3t, w2t): on packed rows
    for an ``"experts": "packed"`` plan, on every slot otherwise."""
    kind = PackedPieces if ref.packed_experts(plan.config) else Pieces
    return kind(slots, out, rank, plan, *operands, grads_into=grads_into)


def run(grad_buf: torch.Tensor, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name: str,
        plan: MoePlan) -> list[torch.Tensor]:
    """By source with the asynchronous functional collectives (gloo here; NCCL on GPUs when
    backward_nccl.py is not usable)."""
    w, rows, h = plan.world, plan.e_local * plan.capacity, plan.hidden
    rank = ref.group_rank(group_name, plan)
    slots, out = grad_buf.view(w, rows, h), grad_buf.new_empty(w, rows, h)
    pieces = make_pieces(slots, out, rank, plan, tokens_t, gate, up, act_t, w1t, w3t, w2t)
    ref.exchange_by_source(slots, out, rank, group_name, pieces.own, pieces.peer, pieces.after)
    return pieces.result()


def run_routed(grad_buf: torch.Tensor, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name: str,
               plan: MoePlan, link=None) -> list[torch.Tensor]:
    """``"payload": "routed"`` (routed.py's rounds): only the gradient rows up to each (destination,
    expert)'s last non-zero row travel and go through the gradient GEMMs. Exact: a zero gradient
    row has a zero d_act, so zero d_up, d_gate and d_h, and adds nothing to the weight gradients,
    which are computed as the section computes them, over g, d_gate and d_up with zeros in every
    row no gradient reached."""
    from . import routed

    w, e, c, h, f = plan.world, plan.e_local, plan.capacity, plan.hidden, plan.ffn
    g = grad_buf.new_zeros(e, w * c, h)
    d_gate, d_up = gate.new_zeros(e, w * c, f), gate.new_zeros(e, w * c, f)
    grads: list[torch.Tensor] = []

    def piece(x: torch.Tensor, source: int, routing) -> torch.Tensor:
        rows = routing.got_rows[source]
        m = routed.trimmed_rows(rows)
        if m is not None:
            cols = slice(source * c, source * c + m)
            x = x.view(e, m, h)
            g[:, cols] = x
            return swiglu_grad(x, gate[:, cols], up[:, cols], w1t, w3t, w2t, d_gate[:, cols], d_up[:, cols])
        index = routing.maps.saved(source)  # [E, W * C, *] rows: the layout of g, gate, up, d_gate, d_up
        g.view(-1, h).index_copy_(0, index, x)
        d_h, dg, du = routed.swiglu_grad_packed(x, rows, routing.offsets[1, source],
                                                gate.reshape(-1, f).index_select(0, index),
                                                up.reshape(-1, f).index_select(0, index), w1t, w3t, w2t)
        d_gate.view(-1, f).index_copy_(0, index, dg)
        d_up.view(-1, f).index_copy_(0, index, du)
        return d_h

    def after() -> None:
        grads.extend([torch.bmm(tokens_t, d_gate), torch.bmm(tokens_t, d_up), torch.bmm(act_t, g)])

    out = routed.exchange(grad_buf, plan, group_name, piece, link, after)
    return [out.view(-1, h), *grads]


def run_as_written(grad_buf: torch.Tensor, tokens_t, gate, up, act_t, w1t, w3t, w2t, group_name: str,
                   plan: MoePlan) -> list[torch.Tensor]:
    """The section as written, one all-to-all each way around the whole gradient: the oracle of
    the tests and the baseline exhaustive search times."""
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    got = comm.wait(comm.start_all_to_all(grad_buf, w, group_name))
    g = got.view(w, e, c, h).transpose(0, 1).reshape(e, w * c, h)
    d_gate, d_up = gate.new_empty(gate.shape), gate.new_empty(gate.shape)
    d_h = swiglu_grad(g, gate, up, w1t, w3t, w2t, d_gate, d_up)
    back = d_h.view(e, w, c, h).transpose(0, 1).reshape(w * e * c, h)
    d_buf = comm.wait(comm.start_all_to_all(back, w, group_name))
    return [d_buf, torch.bmm(tokens_t, d_gate), torch.bmm(tokens_t, d_up), torch.bmm(act_t, g)]
