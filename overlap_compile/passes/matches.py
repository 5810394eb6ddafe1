"""One dataclass per kind of site the finder recognises, with its FX nodes named by role.

A match is pure data: ``find`` builds them without touching the graph, ``decide`` reads their
geometry (``gemms``, ``comm_bytes``, ``signature``), ``rewrite`` uses the nodes. A match whose
``unsupported`` is set was recognised but cannot be rewritten; the reason goes to the Report and
the graph keeps that site exactly as it was.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.fx as fx

from ..predictor.models import dtype_name
from ..tiling import RowStripes
from .graph_utils import aten, is_call

KINDS = ("gemm_allreduce", "gemm_reducescatter", "allgather_gemm", "gemm_alltoall", "moe")


@dataclasses.dataclass
class Match:
    kind: ClassVar[str] = ""
    group_name: str
    world_size: int
    dtype: torch.dtype
    graph: str  # "forward" | "backward" | "inference"
    unsupported: str | None  # reason the site cannot be rewritten, else None

    def gemms(self) -> list[tuple[int, int, int]]:
        """The GEMMs of the site as (M, N, K), M = rows of the full (gathered/unscattered) matrix."""
        raise NotImplementedError

    def comm_bytes(self) -> int:
        """Bytes one rank puts into the collective (its input size)."""
        raise NotImplementedError

    def anchor(self) -> fx.Node:
        """The node the site is reported under (its collective)."""
        raise NotImplementedError

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def signature(self) -> str:
        """Stable text that determines the decision: same on every rank of the group."""
        shapes = ";".join("x".join(map(str, g)) for g in self.gemms())
        extra = self.signature_extra()
        return f"{self.kind}|{shapes}|{dtype_name(self.dtype)}|w{self.world_size}|{extra}"

    def signature_extra(self) -> str:
        return ""

    def name(self) -> str:
        return self.anchor().name


@dataclasses.dataclass
class GemmThenCollective(Match):
    """mm/addmm -> (view chain) -> collective -> wait_tensor. Base of AR, RS and A2A sites.

    ``view_shape`` is the shape of the tensor handed to the collective before any per-rank
    split (the mm output viewed as ``[..., N]``); ``stripes`` says which rows go to which rank
    (None for all-reduce).
    """

    mm_node: fx.Node
    a_node: fx.Node
    b_node: fx.Node
    bias_node: fx.Node | None
    collective_node: fx.Node
    wait_node: fx.Node
    chain_nodes: list[fx.Node]  # everything between mm and the collective (views, split/cat)
    m: int
    n: int
    k: int
    view_shape: tuple[int, ...]
    stripes: RowStripes | None
    reduce_op: str | None
    # Further summands when the collective reads ``mm(a, b) + mm(a2, b2) + ...`` (backward of
    # several column-parallel projections sharing one input): (mm_node, a_node, b_node) each.
    # They are one GEMM over the concatenated K: cat([a, a2], 1) @ cat([b, b2], 0).
    extra_terms: list[tuple[fx.Node, fx.Node, fx.Node]] = dataclasses.field(default_factory=list)
    # Every reader of the collective's result is a pointwise op or a reduction (graph_utils.
    # consumers_fuse): a permuted result (signal_reorder's tile order) is then read in place.
    output_fuses: bool = False

    def operand_nodes(self) -> list[fx.Node]:
        nodes = [self.a_node, self.b_node] + ([self.bias_node] if self.bias_node is not None else [])
        return nodes + [n for _, a, b in self.extra_terms for n in (a, b)]

    def gemms(self) -> list[tuple[int, int, int]]:
        return [(self.m, self.n, self.k)]

    def comm_bytes(self) -> int:
        return self.m * self.n * self.itemsize

    def anchor(self) -> fx.Node:
        return self.collective_node

    def signature_extra(self) -> str:
        s = self.stripes
        stripes = f"{s.outer}x{s.world}x{s.chunk}" if s else "-"
        return (f"{self.reduce_op}|{stripes}|bias={self.bias_node is not None}|terms={1 + len(self.extra_terms)}"
                f"|fuses={self.output_fuses}")


@dataclasses.dataclass
class GemmAllReduceMatch(GemmThenCollective):
    kind: ClassVar[str] = "gemm_allreduce"


@dataclasses.dataclass
class GemmReduceScatterMatch(GemmThenCollective):
    kind: ClassVar[str] = "gemm_reducescatter"
    scatter_dim: int = 0
    # The wait of an all-gather (dim 0, same group) that the result reaches through row-wise ops
    # only, nothing escaping: a template may then scatter rows in another order and fix the
    # order after that all-gather (signal_reorder's subtile form). None when there is no such path.
    subtile_ag_wait: fx.Node | None = None

    def signature_extra(self) -> str:
        return super().signature_extra() + f"|rowwise_ag={self.subtile_ag_wait is not None}"


@dataclasses.dataclass
class GemmAllToAllMatch(GemmThenCollective):
    kind: ClassVar[str] = "gemm_alltoall"


@dataclasses.dataclass
class GemmConsumer:
    """One mm/addmm that reads the gathered matrix as its A operand (row-parallel in the gather)."""

    mm_node: fx.Node
    b_node: fx.Node
    bias_node: fx.Node | None
    n: int


@dataclasses.dataclass
class AllGatherGemmMatch(Match):
    """all_gather_into_tensor -> wait_tensor (-> split/cat for dim > 0) -> view -> one or more mm.

    ``gathered_node`` is the ``[M, K]`` matrix the GEMMs read; its other users (e.g. a saved
    activation for backward) keep reading it, since the template returns it too.
    """

    kind: ClassVar[str] = "allgather_gemm"
    ag_node: fx.Node
    wait_node: fx.Node
    shard_node: fx.Node
    chain_nodes: list[fx.Node]  # split/getitem/cat/views between wait and the gathered matrix
    full_node: fx.Node  # the gathered tensor (wait, or the cat for dim > 0) before flattening
    gathered_node: fx.Node  # the [M, K] matrix (full_node itself when already 2-D)
    gathered_twins: list[fx.Node]  # further views of full_node to the same [M, K] (one per GEMM)
    gathered_shape: tuple[int, ...]  # the gathered tensor before flattening to [M, K]
    gather_dim: int
    consumers: list[GemmConsumer]
    m: int
    k: int
    stripes: RowStripes

    def gemms(self) -> list[tuple[int, int, int]]:
        return [(self.m, c.n, self.k) for c in self.consumers]

    def comm_bytes(self) -> int:
        return self.m // self.world_size * self.k * self.itemsize

    def anchor(self) -> fx.Node:
        return self.ag_node

    def reads_gathered(self) -> bool:
        """Whether the graph reads the gathered matrix beyond the site's GEMMs (a training graph
        saves it for the weight gradients; prefill does not): where it does not, the template
        need not write it out (``AllGatherGemmPlan.gathered``), and is timed so."""
        if not isinstance(self.gathered_node, fx.Node):  # a match built at run time holds no graph
            return True
        gemms = {c.mm_node for c in self.consumers}
        views = {self.gathered_node, *self.gathered_twins}
        for v in views:
            if any(u not in gemms and not is_call(u, aten.sym_size.int) for u in v.users):
                return True
        inner = set(self.chain_nodes) | views
        return self.full_node not in views and any(u not in inner and not is_call(u, aten.sym_size.int)
                                                   for u in self.full_node.users)

    def signature_extra(self) -> str:
        s = self.stripes
        return (f"{s.outer}x{s.world}x{s.chunk}|bias={[c.bias_node is not None for c in self.consumers]}"
                f"|gathered={self.reads_gathered()}")


GEMM_COLLECTIVE_MATCHES = (GemmAllReduceMatch, GemmReduceScatterMatch, GemmAllToAllMatch)


@dataclasses.dataclass
class MoeLayerMatch(Match):
    """An expert-parallel section: all_to_all (dispatch) -> expert GEMMs (bmm) and pointwise ops
    -> all_to_all (combine), found in forward graphs and, mirrored, in backward graphs (the
    gradient all-to-all'd back, the bmm gradients, all-to-all'd again: MoeBackwardMatch, below).
    moe_fused takes the SwiGLU form (in training graphs handing out what backward saves,
    ``saved_nodes``) and its gradient; others are reported with their reason.
    Nodes by role: ``dispatch_a2a``, ``dispatch_wait``, ``expert_bmms``, ``combine_a2a``,
    ``combine_wait``; geometry ``e_local``, ``capacity``, ``hidden``, ``ffn``, ``world``."""

    kind: ClassVar[str] = "moe"
    direction: ClassVar[str] = "forward"  # MoeBackwardMatch: "backward" (read by layers below passes/)
    dispatch_node: fx.Node
    combine_node: fx.Node
    bmm_nodes: list[fx.Node]
    bmm_shapes: list[tuple[int, int, int, int]]  # (batch = local experts, M, N, K) per bmm
    dispatch_bytes: int
    # The SwiGLU expert form (demo.moe), when find_moe verified it: the dispatch buffer, the
    # expert weights, the combine's wait, every node from the dispatch to the combine's wait,
    # and the geometry; None otherwise.
    buffer_node: fx.Node | None = None
    weight_nodes: tuple[fx.Node, fx.Node, fx.Node] | None = None  # w1, w3, w2
    combine_wait: fx.Node | None = None
    section_nodes: list[fx.Node] = dataclasses.field(default_factory=list)
    e_local: int = 0
    capacity: int = 0
    hidden: int = 0
    ffn: int = 0

    dispatch_wait: fx.Node | None = None
    # Section nodes a training graph reads after the section (saved for backward), by role
    # ("tokens", "gate", "up", "act"): moe_fused returns them as extra outputs.
    saved_nodes: dict = dataclasses.field(default_factory=dict)

    # role names (the fields above keep the names the rest of the package was written with)
    @property
    def dispatch_a2a(self) -> fx.Node:
        return self.dispatch_node

    @property
    def combine_a2a(self) -> fx.Node:
        return self.combine_node

    @property
    def expert_bmms(self) -> list[fx.Node]:
        return self.bmm_nodes

    @property
    def world(self) -> int:
        return self.world_size

    def gemms(self) -> list[tuple[int, int, int]]:
        return [(e * m, n, k) for e, m, n, k in self.bmm_shapes]

    def signature_extra(self) -> str:
        return f"e{self.e_local}|c{self.capacity}|h{self.hidden}|f{self.ffn}|saves={','.join(self.saved_nodes)}"

    def comm_bytes(self) -> int:
        return self.dispatch_bytes

    def anchor(self) -> fx.Node:
        return self.dispatch_node


MoeSectionMatch = MoeLayerMatch  # the name it was introduced under


@dataclasses.dataclass
class MoeBackwardMatch(MoeLayerMatch):
    """The backward of a SwiGLU expert section (a training step's backward graph; find_moe_backward
    proves the roles)::

        g = layout(wait(all_to_all(buffer)))                       # dispatch_node: the gradient's a2a
        d_act = bmm(g, w2t); dw2 = bmm(act_t, g)
        d_up, d_gate = pointwise(d_act, gate, up)                  # silu, silu' as Inductor wrote them
        d_h = bmm(d_up, w3t) + bmm(d_gate, w1t); dw3 = bmm(tokens_t, d_up); dw1 = bmm(tokens_t, d_gate)
        all_to_all(layout^-1(d_h)); wait                           # combine_node, combine_wait

    ``bmm_nodes`` / ``bmm_shapes`` are in ``BMM_ROLES`` order once the roles are proven: the
    three GEMMs each piece runs (data gradients) first, then the three weight gradients (the
    latency model, moe_fused/backward_model.py, reads ``gemms()`` in that order).
    ``weight_nodes`` / ``saved_nodes`` (the forward's) stay unset."""

    direction: ClassVar[str] = "backward"
    BMM_ROLES: ClassVar[tuple[str, ...]] = ("d_act", "d_h_gate", "d_h_up", "dw1", "dw3", "dw2")
    # what the op reads besides the gradient buffer, by role: "tokens_t" [E, H, W*C] (the experts'
    # input, transposed, as the dW bmm read it), "gate", "up" [E, W*C, F], "act_t" [E, F, W*C];
    # "w1t", "w3t" [E, F, H], "w2t" [E, H, F] (the weights as the data-gradient bmm read them)
    inputs: dict = dataclasses.field(default_factory=dict)
    bmm_roles: dict = dataclasses.field(default_factory=dict)  # BMM_ROLES -> bmm node
    grad_node: fx.Node | None = None  # g: the gradient of the experts' output, [E, W*C, H]
    d_h_node: fx.Node | None = None  # the sum of the two d_h bmm
    pointwise_nodes: list[fx.Node] = dataclasses.field(default_factory=list)  # d_act -> d_up, d_gate

    def weight_grad_nodes(self) -> tuple[fx.Node, fx.Node, fx.Node]:
        return self.bmm_roles["dw1"], self.bmm_roles["dw3"], self.bmm_roles["dw2"]

    def signature_extra(self) -> str:
        return f"backward|e{self.e_local}|c{self.capacity}|h{self.hidden}|f{self.ffn}"
