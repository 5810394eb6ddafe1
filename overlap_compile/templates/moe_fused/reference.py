"""moe_fused, step by step on any device: the expert-parallel section as a pipeline of pieces.

The section as written (demo.moe)::

    got = all_to_all(buf)                        # [W, E_local, C, H]: every source's slots
    y   = swiglu_experts(got as [E_local, W*C, H])
    out = all_to_all(y as [W, E_local, C, H])    # back to the sources

Every slot goes through the experts alone, so each piece's experts run as soon as it lands and its
combine leaves right after. ``{"split": "source"}`` (default): round r receives source (i - r) % W's
slots (a pairwise all_to_all_single); round 0 is the own tokens, computed while round 1 travels::

        (local)    | dispatch 1 | dispatch 2 ... | combine 1 | combine 2 ...
        experts 0  | experts 1  | experts 2 ...       (combine r after experts r)

    With ``"transport": "p2p"`` the own tokens are cut in two (own_parts)::

        experts own[0] | experts 1 | ... | experts W-1 | experts own[1]

``{"pieces": p}``: the capacity axis C cut into p slices, each a full all-to-all. Collectives are
the asynchronous functional ones on the site's group; padding slots travel as in the original.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...runtime import comm
from ..plans import MoePlan
from .swiglu_kernels import silu_mul

c10d = torch.ops._c10d_functional


def bounds(size: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, size))
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


def packed_experts(config: dict) -> bool:
    """Whether a plan's experts run on the routed rows only (``"experts": "packed"``, packed.py)."""
    return config.get("experts") == "packed"


def experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            out: torch.Tensor | None = None, keep: dict | None = None, packed: bool = False) -> torch.Tensor:
    """SwiGLU over ``[E_local, rows, H]``; written into ``out`` when given (kernels.py).
    ``keep``: role -> view (Saved.of_source / of_capacity) that intermediate goes into: written
    there by its GEMM or the elementwise kernel where the view has the result's shape (a column
    block of the saved layout), copied there otherwise (the capacity pieces' [E, W, n, F]).
    ``packed``: the GEMMs on the routed rows only (packed.experts), the same results."""
    if packed:
        from . import packed as packed_path

        return packed_path.experts(x, w1, w3, w2, out=out, keep=keep)
    keep = keep or {}
    inter = (*x.shape[:-1], w1.shape[-1])

    def into(role: str) -> torch.Tensor | None:
        view = keep.get(role)
        return view if view is not None and tuple(view.shape) == inter else None

    gate, up = torch.bmm(x, w1, out=into("gate")), torch.bmm(x, w3, out=into("up"))
    act = silu_mul(gate, up, out=into("act"))
    values = {"tokens": x, "gate": gate, "up": up, "act": act}
    for role, view in keep.items():
        if values[role] is not view:
            view.copy_(values[role].view(view.shape))
    return torch.bmm(act, w2, out=out)


class Saved:
    """The intermediates a training graph keeps (MoePlan.saves), each ``[E_local, W * C, H|F]``
    laid out as the section as written has them (expert-major, the sources' slots side by
    side), and the views of them one piece of the pipeline fills."""

    def __init__(self, plan: MoePlan, like: torch.Tensor, into: list[torch.Tensor] | None = None):
        """``into``: the tensors to fill, in ``plan.saves`` order (op.py hands its outputs over so
        that a replayed call writes where the caller reads); new ones when None."""
        self.world, self.capacity = plan.world, plan.capacity
        e, wc = plan.e_local, plan.world * plan.capacity
        shapes = {r: (e, wc, plan.hidden if r == "tokens" else plan.ffn) for r in plan.saves}
        if into is None:
            self.tensors = {r: like.new_empty(shape) for r, shape in shapes.items()}
            return
        if [tuple(t.shape) for t in into] != list(shapes.values()):
            raise ValueError(f"moe_fused: saved outputs {[tuple(t.shape) for t in into]} do not match the plan's "
                             f"{list(shapes.values())} ({list(plan.saves)})")
        self.tensors = dict(zip(plan.saves, into))

    def of_source(self, source: int, part: tuple[slice, slice] | None = None) -> dict:
        """Views of source ``source``'s slots (``part``: an own_parts piece of them)."""
        ex, rows = part or (slice(None), slice(None))
        lo = source * self.capacity + (rows.start or 0)
        hi = source * self.capacity + (self.capacity if rows.stop is None else rows.stop)
        return {r: t[ex, lo:hi] for r, t in self.tensors.items()}

    def of_capacity(self, lo: int, hi: int) -> dict:
        """Views of capacity slice [lo, hi) of every source, ``[E, W, hi - lo, *]``."""
        return {r: t.view(t.shape[0], self.world, self.capacity, t.shape[2])[:, :, lo:hi]
                for r, t in self.tensors.items()}

    def result(self, out: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """What an implementation returns: ``out``, or ``[out, *intermediates]`` when some are saved."""
        return [out, *self.tensors.values()] if self.tensors else out


def by_source(config: dict) -> bool:
    return config.get("split", "capacity" if "pieces" in config else "source") == "source"


def zero_past_fill(t: torch.Tensor, dim: int, capacity: int, fill: float) -> torch.Tensor:
    """``t`` with its rows along ``dim`` taken in groups of ``capacity`` slots, each group's slots
    past ``round(fill * capacity)`` zeroed in place: slots as a router leaves them (routed rows
    first, then zeros), for operands that stand in for a layer's (the predictor's measurements,
    predictor/exhaustive.py). Returns ``t``."""
    if not 0.0 <= fill <= 1.0 or t.shape[dim] % capacity:
        raise ValueError(f"moe_fused zero_past_fill: fill {fill} must be in [0, 1] and dim {dim} of {tuple(t.shape)} "
                         f"a multiple of the capacity {capacity}")
    kept = round(fill * capacity)
    t.unflatten(dim, (-1, capacity)).narrow(dim + 1, kept, capacity - kept).zero_()
    return t


def own_parts(e_local: int, capacity: int) -> list[tuple[slice, slice]]:
    """The own tokens in two contiguous halves, as (experts, capacity rows) slices of [E, C, H]:
    by experts when there are two or more, else by capacity rows (one expert)."""
    if e_local >= 2:
        half = e_local // 2
        return [(slice(0, half), slice(0, capacity)), (slice(half, e_local), slice(0, capacity))]
    half = max(1, capacity // 2)
    return [(slice(0, 1), slice(0, half)), (slice(0, 1), slice(half, capacity))]


def own_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
                part: tuple[slice, slice], saved: "Saved | None" = None, rank: int = 0, packed: bool = False) -> None:
    """One of own_parts of the own tokens ``x`` [E, C, H] through its experts, into ``out`` [E, C, H]
    (and its intermediates into ``saved``, at source ``rank``'s columns)."""
    ex, rows = part
    keep = saved.of_source(rank, part) if saved is not None else None
    experts(x[ex, rows], w1[ex], w3[ex], w2[ex], out=out[ex, rows], keep=keep, packed=packed)


def round_peers(rank: int, world: int, r: int) -> tuple[int, int]:
    """Round r's (destination of my dispatch piece, source of the piece I receive)."""
    return (rank + r) % world, (rank - r) % world


def one_peer_splits(world: int, peer: int, rows: int) -> list[int]:
    """all_to_all_single splits that move ``rows`` rows to / from ``peer`` only."""
    return [rows if j == peer else 0 for j in range(world)]


def run(buf: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group_name: str,
        plan: MoePlan) -> torch.Tensor | list[torch.Tensor]:
    """The combined slots ``[W * E_local * C, H]``; with ``plan.saves``, ``[that, *intermediates]``
    (Saved). The implementations in kernels.py / kernels_nccl.py return the same."""
    if by_source(plan.config):
        return run_by_source(buf, w1, w3, w2, group_name, plan)
    return run_by_capacity(buf, w1, w3, w2, group_name, plan)


def run_by_source(buf, w1, w3, w2, group_name: str, plan: MoePlan) -> torch.Tensor:
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    rank = group_rank(group_name, plan)
    rows = e * c
    slots, out = buf.view(w, rows, h), buf.new_empty(w, rows, h)
    saved = Saved(plan, buf)
    # the own tokens' experts run while the first pieces travel (over the copy engine: the first
    # half only, the second after the peers' pieces)
    own, own_out = slots[rank].view(e, c, h), out[rank].view(e, c, h)
    parts = own_parts(e, c) if plan.config.get("transport") == "p2p" else [(slice(0, e), slice(0, c))]
    packed = packed_experts(plan.config)

    def peer(src: int, got: torch.Tensor) -> torch.Tensor:
        return experts(got.view(e, c, h), w1, w3, w2, keep=saved.of_source(src), packed=packed).view(rows, h)

    def rest() -> None:
        for part in parts[1:]:
            own_experts(own, w1, w3, w2, own_out, part, saved, rank, packed)

    exchange_by_source(slots, out, rank, group_name,
                       lambda: own_experts(own, w1, w3, w2, own_out, parts[0], saved, rank, packed), peer, rest)
    return saved.result(out.view(w * rows, h))


def group_rank(group_name: str, plan: MoePlan) -> int:
    """This rank in the group, which must have the plan's size."""
    rank, size = comm.rank_and_size(group_name)
    if size != plan.world:
        raise ValueError(f"moe_fused: group {group_name!r} has {size} ranks, the plan was made for {plan.world}")
    return rank


def exchange_by_source(slots: torch.Tensor, out: torch.Tensor, rank: int, group_name: str, own: Callable[[], None],
                       peer: Callable[[int, torch.Tensor], torch.Tensor], after: Callable[[], None]) -> None:
    """The rounds by source, both directions of a training step (moe_fused, moe_fused_backward):
    ``slots`` [W, rows, H] (block j goes to rank j), ``out`` [W, rows, H] (block j comes back from
    rank j). Every piece is started first, in round order (the same on every rank); ``own()``
    computes the rank's own block (no transfer, it writes its result into ``out[rank]``) while
    they travel; ``peer(src, got)`` computes the block received from ``src`` once it has landed
    and returns the ``[rows, H]`` result, which goes home at once; ``after()`` runs once every
    piece is computed, while the last results travel. kernels_nccl.rounds_by_source is the same
    on CUDA streams."""
    w, rows = slots.shape[0], slots.shape[1]
    sent = []
    for r in range(1, w):
        dst, src = round_peers(rank, w, r)
        # splits cut the input at prefix sums: the one non-empty piece starts at row 0 of it
        sent.append(c10d.all_to_all_single.default(slots[dst], one_peer_splits(w, src, rows),
                                                   one_peer_splits(w, dst, rows), group_name))
    own()
    back = []
    for r, t in enumerate(sent, start=1):
        dst, src = round_peers(rank, w, r)
        y = peer(src, comm.wait(t))
        back.append(c10d.all_to_all_single.default(y, one_peer_splits(w, dst, rows),
                                                   one_peer_splits(w, src, rows), group_name))
    after()
    for r, t in enumerate(back, start=1):
        dst, _ = round_peers(rank, w, r)
        out[dst] = comm.wait(t)


def run_by_capacity(buf, w1, w3, w2, group_name: str, plan: MoePlan) -> torch.Tensor:
    w, e, c, h = plan.world, plan.e_local, plan.capacity, plan.hidden
    slots = buf.view(w, e, c, h)
    pieces = bounds(c, plan.config.get("pieces", 1))
    sent = [comm.start_all_to_all(slots[:, :, lo:hi].reshape(-1, h), w, group_name) for lo, hi in pieces]
    saved = Saved(plan, buf)
    back = []
    for (lo, hi), t in zip(pieces, sent):
        n = hi - lo
        got = comm.wait(t).view(w, e, n, h).transpose(0, 1).reshape(e, w * n, h)
        y = experts(got, w1, w3, w2, keep=saved.of_capacity(lo, hi)).view(e, w, n, h).transpose(0, 1).reshape(-1, h)
        back.append(comm.start_all_to_all(y, w, group_name))
    out = buf.new_empty(w, e, c, h)
    for (lo, hi), t in zip(pieces, back):
        out[:, :, lo:hi] = comm.wait(t).view(w, e, hi - lo, h)
    return saved.result(out.view(w * e * c, h))
