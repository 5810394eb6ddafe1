"""The ops of sites whose row count M is symbolic: one call that picks, by the run's M, the choice
the decision made for M's bucket (predictor/buckets.py).

    overlap_compile::bucketed_gemm_collective(a, b, bias, group_name, table) -> [result rows, n]
    overlap_compile::bucketed_allgather_gemm(shard, bs, biases, group_name, table) -> [gathered, y_0, ...]

``table`` (``BucketTable``, JSON) holds the site's static geometry and, per bucket, a template and
configuration or "baseline". The op finds M's bucket and runs the template's own op on the
operands with the bucket's plan at this M, refitting M-dependent configs (``fit_config``); a
template that emits its site its own way (signal_reorder) is emitted eagerly from a match of M.
Where the template refuses this M or the bucket says "baseline", it runs the GEMM, then the
collective: in a host-launched compile with op graphs on (``replay_written``) as priority_stream's
one-chunk op, which runtime.op_graphs replays from a CUDA graph (one launch for the pair instead of
the GEMM's and c10d's host work), else launched from Python. Choices are cached per (table, M);
the fake impl returns the collective's symbolic sizes.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from ..predictor.buckets import choose
from ..tiling import RowStripes, call_op
from .base import _LIBRARY, LIB

BASELINE = "baseline"
# the site as written, issued by a template op: the GEMM whole, then the collective on the
# priority stream, joined before the result is read; one op call that op graphs can replay
WRITTEN_TEMPLATE = "priority_stream"
WRITTEN_CONFIG = {"chunks": 1, "block_m": None, "block_n": None, "stages": None}
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class BucketTable:
    """A symbolic site's run-time table: ``kind``, ``world``, the GEMM's static sizes (``n`` and
    ``k``; all-gather: ``ns``), ``reduce_op``, ``has_bias`` (a tuple for all-gather), the row
    stripes' static factor (``outer`` or ``chunk``, the other None; both None for all-reduce),
    ``buckets``: [{"max_m": int | None, "template": str, "config": dict | None}] in M order."""

    kind: str
    world: int
    k: int
    n: int = 0
    ns: tuple = ()
    reduce_op: str | None = None
    has_bias: Any = False
    outer: int | None = None
    chunk: int | None = None
    buckets: tuple = ()
    timeout_ms: int = 10000
    gathered: bool = True
    # "as written" buckets run the GEMM and the collective as WRITTEN_TEMPLATE's one-chunk form,
    # which runtime.op_graphs replays from a CUDA graph (host-launched compiles with op graphs on)
    replay_written: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_json(text: str) -> "BucketTable":
        d = json.loads(text)
        d["ns"], d["buckets"] = tuple(d["ns"]), tuple(d["buckets"])
        if isinstance(d["has_bias"], list):
            d["has_bias"] = tuple(d["has_bias"])
        return BucketTable(**d)

    def stripes(self, m: int) -> RowStripes | None:
        """The row stripes at M (None for all-reduce). M that the stripes do not divide gives
        stripes of other row count: the caller checks ``rows``."""
        if self.outer is None and self.chunk is None:
            return None
        if self.outer is not None:
            return RowStripes(self.outer, self.world, m // (self.outer * self.world))
        return RowStripes(m // (self.chunk * self.world), self.world, self.chunk)

    def result_rows(self, m: Any) -> Any:
        """Rows of the collective's result at M (int or SymInt), as the collective's own shape
        function gives them."""
        if self.kind == "gemm_reducescatter":
            return m // self.world
        if self.kind == "gemm_alltoall":
            return (m // self.world) * self.world
        return m


# ---- the choice at one M ---------------------------------------------------------------------

def fit_config(config: dict | None, match: Any, spec: Any) -> dict | None:
    """The bucket's configuration at this M. A wave-group schedule (signal_reorder) is rebuilt for
    this M's tile count with the same tiles, program count (clamped to the tiles) and number of
    groups; the subtile reduce-scatter form (it needs a row fix after a later all-gather in the
    graph) is never used here. Other configurations do not depend on M."""
    if config is None or "wave_groups" not in config:
        return config
    from ..tiling import TileGrid, cdiv, even_wave_groups

    cfg = {k: v for k, v in config.items() if k != "rs_layout"}
    stripes = 1 if match.kind == "gemm_allreduce" else match.world_size
    rows = match.m if match.kind == "gemm_allreduce" else match.stripes.stripe_rows
    grid = TileGrid(max(1, rows), match.n, cfg["block_m"], cfg["block_n"], cfg["group_m"])
    tiles = grid.num_tiles * stripes
    programs = max(stripes, min(int(cfg["programs"]), tiles) // stripes * stripes)
    waves = cdiv(tiles, programs)
    cfg["programs"] = programs
    cfg["wave_groups"] = list(even_wave_groups(waves, len(config["wave_groups"])))
    return cfg


# (table, M, group) -> (template, plan JSON, why): the choice of each M a site ran at
_choices: dict[tuple[str, int, str], tuple[str, str | None, str]] = {}


def choices_made() -> list[tuple[int, str, str]]:
    """(M, template, why) of every choice made since ``clear_choices`` (tests, diagnostics)."""
    return [(key[1], got[0], got[2]) for key, got in _choices.items()]


def clear_choices() -> None:
    _choices.clear()


def _choice(table_json: str, m: int, group_name: str) -> tuple[str, str | None, str]:
    """(template, plan JSON, why) at this M; template "baseline" where the bucket says so or the
    template cannot take this M (why says which), its plan WRITTEN_TEMPLATE's one-chunk plan
    where the table replays the site as written and that template takes this M, else None."""
    key = (table_json, m, group_name)
    got = _choices.get(key)
    if got is None:
        got = _choices[key] = _choose_at(table_json, m, group_name)
    return got


def _choose_at(table_json: str, m: int, group_name: str) -> tuple[str, str | None, str]:
    t = BucketTable.from_json(table_json)
    entry = choose(list(t.buckets), m)
    why = "the bucket's choice"
    if entry["template"] != BASELINE:
        plan, problem = _plan_at(t, m, group_name, entry["template"], entry["config"])
        if plan is not None:
            return entry["template"], plan, why
        why = problem
    written = _plan_at(t, m, group_name, WRITTEN_TEMPLATE, WRITTEN_CONFIG)[0] if t.replay_written else None
    return BASELINE, written, why


def _plan_at(t: BucketTable, m: int, group_name: str, name: str, config: dict | None) -> tuple[str | None, str]:
    """(``name``'s plan JSON for the site at this M, "") or (None, why that template cannot take it)."""
    from . import get_spec

    spec = get_spec(name)
    match = concrete_match(t, m, group_name, None, None, None)
    stripes = match.stripes if t.kind != "gemm_allreduce" else None
    if stripes is not None and stripes.rows != m:
        return None, f"M={m} is not a multiple of the row stripes' {stripes.outer * t.world} x chunk"
    problem = spec.supports(match)
    if problem:
        return None, problem
    try:
        plan = spec.plan(match, fit_config(config, match, spec), t.timeout_ms)
    except ValueError as e:
        return None, str(e)
    if t.kind == "allgather_gemm" and not t.gathered:
        plan = dataclasses.replace(plan, gathered=False)
    return plan.to_json(), ""


def concrete_match(t: BucketTable, m: int, group_name: str, a: Any, b: Any, bias: Any) -> Any:
    """The site at this M as a match of its kind, holding tensors (or None) where a graph's
    match holds nodes: what a template's ``supports``, ``plan`` and emitters read."""
    from ..passes import matches as mt

    common = dict(group_name=group_name, world_size=t.world, dtype=None, graph="run", unsupported=None)
    stripes = t.stripes(m)
    if a is None:  # no tensors (the choice at this M): a placeholder where the site has a bias
        b, bias = ([None] * len(t.ns), [True if hb else None for hb in t.has_bias]) if t.kind == "allgather_gemm" \
            else (None, True if t.has_bias else None)
    if t.kind == "allgather_gemm":
        consumers = [mt.GemmConsumer(mm_node=None, b_node=bb, bias_node=bi, n=n) for n, bb, bi in zip(t.ns, b, bias)]
        return mt.AllGatherGemmMatch(**common, ag_node=None, wait_node=None, shard_node=a, chain_nodes=[],
                                     full_node=None, gathered_node=None, gathered_twins=[], gathered_shape=(m, t.k),
                                     gather_dim=0, consumers=consumers, m=m, k=t.k, stripes=stripes)
    cls = {"gemm_allreduce": mt.GemmAllReduceMatch, "gemm_reducescatter": mt.GemmReduceScatterMatch,
           "gemm_alltoall": mt.GemmAllToAllMatch}[t.kind]
    return cls(**common, mm_node=None, a_node=a, b_node=b, bias_node=bias,
               collective_node=None, wait_node=None, chain_nodes=[], m=m, n=t.n, k=t.k, view_shape=(m, t.n),
               stripes=stripes, reduce_op=t.reduce_op)


# ---- the ops ---------------------------------------------------------------------------------

def run_gemm_collective(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                        table: str) -> torch.Tensor:
    t = BucketTable.from_json(table)
    m = a.shape[0]
    name, plan_json, _ = _choice(table, m, group_name)
    if name == BASELINE:
        if plan_json is None:
            return _baseline_gemm_collective(t, a, b, bias, group_name, m)
        name = WRITTEN_TEMPLATE
    op = _as_emitted(name, "gemm_collective")
    if op is not None:
        rows = op(a, b, bias, group_name, plan_json)
    else:
        from . import get_spec
        from .plans import GemmCollectivePlan

        rows = get_spec(name).emit_gemm_collective(call_op, concrete_match(t, m, group_name, a, b, bias),
                                                   GemmCollectivePlan.from_json(plan_json))
    return rows.reshape(t.result_rows(m), t.n).contiguous()


def run_allgather_gemm(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None],
                       group_name: str, table: str) -> list[torch.Tensor]:
    t = BucketTable.from_json(table)
    m = shard.shape[0] * t.world
    name, plan_json, _ = _choice(table, m, group_name)
    if name == BASELINE:
        if plan_json is None:
            return _baseline_allgather_gemm(t, shard, bs, biases, group_name, m)
        name = WRITTEN_TEMPLATE
    op = _as_emitted(name, "allgather_gemm")
    if op is not None:
        outs = op(shard.reshape(m // t.world, t.k), bs, biases, group_name, plan_json)
    else:
        from . import get_spec
        from .plans import AllGatherGemmPlan

        outs = get_spec(name).emit_allgather_gemm(call_op, concrete_match(t, m, group_name, shard, bs, biases),
                                                  AllGatherGemmPlan.from_json(plan_json))
    return [o.contiguous() for o in outs]


@functools.lru_cache(maxsize=None)
def _as_emitted(template: str, what: str) -> Any:
    """The template op's Python kernel where its spec emits the site as TemplateSpec does (the op
    alone on the site's operands and the plan text), called directly: building the site's match
    and emitting it, or a second trip through the dispatcher, cost the host more on every call.
    None where the spec emits its own way (signal_reorder's reduce-scatter forms). Once per
    (template, op)."""
    from . import get_spec
    from .base import KERNELS, TemplateSpec

    emitter = f"emit_{what}"
    if getattr(type(get_spec(template)), emitter) is not getattr(TemplateSpec, emitter):
        return None
    name = f"{template}_{what}"
    return KERNELS.get(name) or getattr(torch.ops.overlap_compile, name).default


def _baseline_gemm_collective(t: BucketTable, a, b, bias, group_name: str, m: int) -> torch.Tensor:
    """The site as written: the GEMM, then the collective on its rows in the collective's order."""
    y = torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)
    if t.kind == "gemm_allreduce":
        return c10d.wait_tensor(c10d.all_reduce(y, t.reduce_op, group_name))
    if t.kind == "gemm_reducescatter":
        s = t.stripes(m)
        if s.outer > 1 and s.rows == m:  # stripes of a dim > 0: rank k's rows first, as split/cat put them
            y = y.view(s.outer, t.world, s.chunk, t.n).transpose(0, 1).reshape(m, t.n)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y.contiguous(), t.reduce_op, t.world, group_name))
    splits = [m // t.world] * t.world
    return c10d.wait_tensor(c10d.all_to_all_single(y, splits, splits, group_name))


def _baseline_allgather_gemm(t: BucketTable, shard, bs, biases, group_name: str, m: int) -> list[torch.Tensor]:
    # the out= form, as Inductor's own code calls it: the plain one also runs a Python autograd
    # kernel on every call (host time, in decode-sized calls that are host-bound)
    g = shard.new_empty(m, t.k)
    g = c10d.wait_tensor(c10d.all_gather_into_tensor_out(shard.contiguous(), t.world, group_name, out=g))
    s = t.stripes(m)
    full = g if s.outer == 1 else g.view(t.world, s.outer, s.chunk, t.k).transpose(0, 1).reshape(m, t.k)
    ys = [torch.addmm(bi, full, bb) if bi is not None else torch.mm(full, bb) for bb, bi in zip(bs, biases)]
    return [full.contiguous(), *ys]


def _fake_gemm_collective(a, b, bias, group_name, table):
    t = BucketTable.from_json(table)
    return a.new_empty(t.result_rows(a.shape[0]), t.n)


def _fake_allgather_gemm(shard, bs, biases, group_name, table):
    t = BucketTable.from_json(table)
    m = shard.shape[0] * t.world
    return [shard.new_empty(m, t.k)] + [shard.new_empty(m, n) for n in t.ns]


def _define() -> None:
    _LIBRARY.define("bucketed_gemm_collective(Tensor a, Tensor b, Tensor? bias, str group_name, str table) -> Tensor")
    _LIBRARY.define("bucketed_allgather_gemm(Tensor shard, Tensor[] bs, Tensor?[] biases, str group_name, "
                    "str table) -> Tensor[]")
    for name, kernel, fake in (("bucketed_gemm_collective", run_gemm_collective, _fake_gemm_collective),
                               ("bucketed_allgather_gemm", run_allgather_gemm, _fake_allgather_gemm)):
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, kernel, key)
        torch.library.register_fake(f"{LIB}::{name}", fake, lib=_LIBRARY)


_define()
bucketed_gemm_collective = torch.ops.overlap_compile.bucketed_gemm_collective.default
bucketed_allgather_gemm = torch.ops.overlap_compile.bucketed_allgather_gemm.default
