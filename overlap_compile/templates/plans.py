"""Plans: everything a template's op needs to know at run time, as a JSON string op argument.

A plan is built at compile time from a Match and the chosen config. It is a string so that it
is hashable and printable in the graph (and in the FX graph cache key), and it is the same
text on every rank, which is how the decision-agreement check compares ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any

from ..tiling import RowStripes


def _json_once(plan: Any) -> str:
    """A frozen plan's JSON text, made once: the bucketed ops emit their site's op on every call,
    and asdict + dumps would cost tens of microseconds of host time each time."""
    text = plan.__dict__.get("_json")
    if text is None:
        text = json.dumps(dataclasses.asdict(plan), sort_keys=True, separators=(",", ":"))
        object.__setattr__(plan, "_json", text)
    return text


@dataclasses.dataclass(frozen=True)
class GemmCollectivePlan:
    """GEMM ``[m, k] @ [k, n] (+ bias)`` followed by a collective on its rows.

    ``kind`` is the match kind. For reduce-scatter and all-to-all, ``outer``/``chunk`` give the
    row stripes (tiling.RowStripes) each rank owns; for all-reduce they are unused (1, m).
    """

    template: str
    kind: str
    m: int
    n: int
    k: int
    world: int
    reduce_op: str | None
    outer: int
    chunk: int
    has_bias: bool
    config: dict
    timeout_ms: int = 10000
    gathered: bool = True

    @property
    def stripes(self) -> RowStripes:
        return RowStripes(self.outer, self.world, self.chunk)

    @property
    def result_rows(self) -> int:
        """Rows of the collective's result matrix on one rank."""
        if self.kind == "gemm_reducescatter":
            return self.outer * self.chunk
        return self.m

    def to_json(self) -> str:
        return _json_once(self)

    @staticmethod
    @functools.lru_cache(maxsize=512)  # ops parse their plan on every call: once per plan text
    def from_json(text: str) -> "GemmCollectivePlan":
        return GemmCollectivePlan(**_load(text, "GemmCollectivePlan"))


@dataclasses.dataclass(frozen=True)
class AllGatherGemmPlan:
    """All-gather of ``[m / world, k]`` row shards (placed by ``outer``/``chunk`` stripes) feeding
    one GEMM per entry of ``ns`` (``[m, k] @ [k, n_i] (+ bias_i)``). ``gathered``: whether the
    graph reads the gathered matrix (the op's first output) beyond those GEMMs; where it does not
    (passes/rewrite.py finds out), a template may leave that output unwritten."""

    template: str
    m: int
    k: int
    ns: tuple[int, ...]
    world: int
    outer: int
    chunk: int
    has_bias: tuple[bool, ...]
    config: dict
    timeout_ms: int = 10000
    gathered: bool = True

    @property
    def stripes(self) -> RowStripes:
        return RowStripes(self.outer, self.world, self.chunk)

    def to_json(self) -> str:
        return _json_once(self)

    @staticmethod
    @functools.lru_cache(maxsize=512)  # ops parse their plan on every call: once per plan text
    def from_json(text: str) -> "AllGatherGemmPlan":
        d = _load(text, "AllGatherGemmPlan")
        d["ns"], d["has_bias"] = tuple(d["ns"]), tuple(d["has_bias"])
        return AllGatherGemmPlan(**d)


# ---- all-reduce = reduce-scatter over W row stripes + all-gather of the reduced stripes --------
# (p2p_ring and tile_fused build their all-reduce from their two halves)

def allreduce_stripes(plan: GemmCollectivePlan) -> GemmCollectivePlan:
    """The reduce-scatter half of an all-reduce plan: the output cut into W row stripes."""
    if plan.m % plan.world:
        raise ValueError(f"{plan.template}: all-reduce cuts the {plan.m} output rows into {plan.world} stripes; "
                         f"m must be a multiple of the world size")
    return dataclasses.replace(plan, kind="gemm_reducescatter", outer=1, chunk=plan.m // plan.world,
                               config=_halves_config(plan.config))


def allreduce_chunks(plan: GemmCollectivePlan) -> list[tuple[int, int, GemmCollectivePlan]]:
    """``(lo, hi, plan of rows [lo, hi))`` for each row chunk an all-reduce plan's ``"chunks"``
    (default 1) cuts the output into: nearly equal, each a multiple of W rows (its own W
    stripes), at most m / W of them."""
    allreduce_stripes(plan)  # m must be a multiple of W (the error names it)
    units = plan.m // plan.world
    parts = max(1, min(int(plan.config.get("chunks", 1)), units))
    spans = [(plan.world * (units * i // parts), plan.world * (units * (i + 1) // parts)) for i in range(parts)]
    return [(lo, hi, dataclasses.replace(plan, m=hi - lo, chunk=hi - lo)) for lo, hi in spans]


def allreduce_gather(plan: GemmCollectivePlan) -> "AllGatherGemmPlan":
    """The all-gather half: the W reduced ``[m / W, n]`` stripes, no GEMM after it."""
    return AllGatherGemmPlan(template=plan.template, m=plan.m, k=plan.n, ns=(), world=plan.world, outer=1,
                             chunk=plan.m // plan.world, has_bias=(), config=_halves_config(plan.config),
                             timeout_ms=plan.timeout_ms)


def _halves_config(config: dict) -> dict:
    """An all-reduce's config as its halves take it: ``"chunks"`` is the all-reduce's own."""
    return {k: v for k, v in config.items() if k != "chunks"}


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed {what} (not JSON: {e}): {text[:200]!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"malformed {what}: expected a JSON object, got {text[:200]!r}")
    return d


@functools.lru_cache(maxsize=512)
def plan_digest(plan_json: str) -> str:
    """Short hash of a plan, compared across ranks before the first run of a rewritten op."""
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class MoePlan:
    """An expert-parallel SwiGLU section: dispatch buffer ``[W * e_local * capacity, hidden]``,
    local experts' weights ``[e_local, hidden, ffn]`` (w1, w3) and ``[e_local, ffn, hidden]`` (w2)."""

    template: str
    world: int
    e_local: int
    capacity: int
    hidden: int
    ffn: int
    config: dict
    timeout_ms: int = 10000
    # intermediates the op also returns, in this order, each [e_local, W * capacity, hidden|ffn]
    # as the section computed them: "tokens" (the experts' input), "gate", "up", "act" (what a
    # training graph saves for backward; passes.find_moe.SAVE_ROLES)
    saves: tuple[str, ...] = ()
    # "forward": the section (op moe_fused); "backward": its gradient in a training step's backward
    # graph (op moe_fused_backward, which saves nothing). Part of the plan text, so the two ops of
    # one layer never share a plan digest (runtime/agreement.py checks each on its first run).
    direction: str = "forward"

    def __post_init__(self) -> None:
        object.__setattr__(self, "saves", tuple(self.saves))
        bad = [s for s in self.saves if s not in MOE_SAVE_ROLES]
        if bad:
            raise ValueError(f"MoePlan.saves: unknown roles {bad}; allowed: {list(MOE_SAVE_ROLES)}")
        if self.direction not in ("forward", "backward") or (self.direction == "backward" and self.saves):
            raise ValueError(f"MoePlan.direction: 'forward' or 'backward' (which saves nothing); got "
                             f"{self.direction!r} with saves {list(self.saves)}")

    def to_json(self) -> str:
        return _json_once(self)

    @staticmethod
    @functools.lru_cache(maxsize=512)  # ops parse their plan on every call: once per plan text
    def from_json(text: str) -> "MoePlan":
        return MoePlan(**_load(text, "MoePlan"))


MOE_SAVE_ROLES = ("tokens", "gate", "up", "act")
