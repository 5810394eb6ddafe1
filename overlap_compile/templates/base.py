"""What every template provides, and the shared op plumbing.

A template is a folder ``templates/<name>/`` with

* ``spec.py``: a ``TemplateSpec`` subclass: which match kinds it supports (``supports``), its
  configurations (``candidates``, ``default_config``), the graph it emits (``emit_*``) and its
  closed-form latency model (``predict``, used by the predictor);
* ``op.py``: the ``torch.ops.overlap_compile.<name>_*`` ops (fake impl + device dispatch);
* ``reference.py``: the decomposed algorithm step by step on any device (CPU/gloo in CI);
* ``kernels.py``: the GPU implementation (Triton kernels, streams).

Streams and the caching allocator: a GPU call ends with the caller's stream waiting for its side
streams (the join), and every caller-stream tensor a side stream touches stays referenced until
then, so a block the caller frees later is handed out again only behind that work. No
``record_stream``: with it a freed block came back once the side stream's queue passed the free,
a moment set by how far the GPU trails the host, so a training step's buffers moved between
steps and the ops' CUDA graphs (runtime.op_graphs, keyed on addresses) were never replayed. An
op whose join comes later (priority_stream's prioritized_collective) holds its input until then.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..passes.matches import AllGatherGemmMatch, GemmThenCollective, Match
from .plans import AllGatherGemmPlan, GemmCollectivePlan

LIB = "overlap_compile"


def gpu_profile(profile: Any) -> bool:
    """A hardware profile of a GPU (not cpu-gloo): candidates offer only configs with a GPU path."""
    gpu = str(getattr(profile, "gpu", "") or "")
    return profile is not None and bool(gpu) and not gpu.upper().startswith("CPU")


class TemplateSpec:
    name: str = ""
    kinds: tuple[str, ...] = ()
    # False while the template runs on GPUs only through its step-by-step reference: the
    # predictor then offers it no candidates under a GPU profile (force_template still can).
    gpu_implemented: bool = True
    # True when the op's host-launched GPU calls go through runtime.op_graphs (define_*_op with a
    # graphable route): the predictor prices their host time as a graph replay
    host_replay: bool = False

    def replays_on_host(self, match: Match) -> bool:
        """Whether host-launched calls of this site's op replay from per-site CUDA graphs (what
        the predictor prices); a template whose ops differ per site overrides it."""
        return self.host_replay

    # -- what it can do -------------------------------------------------------------------
    def supports(self, match: Match) -> str | None:
        """None when this template can rewrite the site, else the reason it cannot."""
        if match.kind not in self.kinds:
            return f"{self.name} does not implement {match.kind} (it implements {', '.join(self.kinds)})"
        return None

    def gpu_refusal(self, match: Match) -> str | None:
        """Why this template must not run its GPU kernels on this site (None: it may): a path
        known or not yet shown to be right. Checked under GPU profiles, ``force_template`` too."""
        return None

    def default_config(self, match: Match) -> dict:
        raise NotImplementedError

    def candidates(self, match: Match, profile: Any) -> list[dict]:
        """Configurations worth predicting for this site (the predictor ranks them)."""
        return [self.default_config(match)]

    def predict(self, match: Match, config: dict, profile: Any) -> float | None:
        """Predicted milliseconds of the site under ``config`` (None: no model yet)."""
        return None

    def workspace_bytes(self, match: Match, config: dict) -> dict | None:
        """Memory the rewritten site holds beyond its inputs and output, by kind ("persistent":
        kept between calls, e.g. symmetric buffers; "per_call": allocated and freed by each
        call), for the Report (None: not worked out for this template)."""
        return None

    # -- what it emits --------------------------------------------------------------------
    def plan(self, match: Match, config: dict, timeout_ms: int) -> GemmCollectivePlan | AllGatherGemmPlan:
        """The run-time plan of this site under ``config`` (an op argument, as JSON)."""
        if isinstance(match, AllGatherGemmMatch):
            s = match.stripes
            return AllGatherGemmPlan(
                template=self.name, m=match.m, k=match.k, ns=tuple(c.n for c in match.consumers),
                world=match.world_size, outer=s.outer, chunk=s.chunk,
                has_bias=tuple(c.bias_node is not None for c in match.consumers), config=config,
                timeout_ms=timeout_ms, gathered=match.reads_gathered(),
            )
        s = match.stripes
        return GemmCollectivePlan(
            template=self.name, kind=match.kind, m=match.m, n=match.n, k=match.k, world=match.world_size,
            reduce_op=match.reduce_op, outer=s.outer if s else 1, chunk=s.chunk if s else match.m,
            has_bias=match.bias_node is not None, config=config, timeout_ms=timeout_ms,
        )

    def emit_gemm_collective(self, emit: Callable, match: GemmThenCollective, plan: GemmCollectivePlan) -> fx.Node:
        """Insert the template's op; return the node holding the collective's result rows
        as a ``[plan.result_rows, n]`` matrix."""
        op = getattr(torch.ops.overlap_compile, f"{self.name}_gemm_collective").default
        a, b = gemm_operands(emit, match)
        return emit(op, a, b, match.bias_node, match.group_name, plan.to_json())

    def emit_allgather_gemm(self, emit: Callable, match: AllGatherGemmMatch, plan: AllGatherGemmPlan) -> list[fx.Node]:
        """Insert the op; return nodes for [gathered matrix, output of consumer 0, 1, ...]."""
        import operator

        op = getattr(torch.ops.overlap_compile, f"{self.name}_allgather_gemm").default
        shard = emit(torch.ops.aten.reshape.default, match.shard_node, [plan.m // plan.world, plan.k])
        out = emit(
            op,
            shard,
            [c.b_node for c in match.consumers],
            [c.bias_node for c in match.consumers],
            match.group_name,
            plan.to_json(),
        )
        return [emit(operator.getitem, out, i) for i in range(1 + len(match.consumers))]


def gemm_operands(emit: Callable, match: GemmThenCollective) -> tuple[fx.Node, fx.Node]:
    """A and B of the site's GEMM; a sum of GEMMs becomes one GEMM over the concatenated K."""
    if not match.extra_terms:
        return match.a_node, match.b_node
    a = emit(torch.ops.aten.cat.default, [match.a_node] + [t[1] for t in match.extra_terms], 1)
    b = emit(torch.ops.aten.cat.default, [match.b_node] + [t[2] for t in match.extra_terms], 0)
    return a, b


# ---- op plumbing shared by every template ------------------------------------------------
#
# The ops are declared with the low-level torch.library API (schema + one Python kernel per
# device + a fake impl) rather than ``torch.library.custom_op``, whose Python wrapper checks every
# call's outputs for aliasing: 13-18 us per call on the dispatch path alone, which a host-launched
# graph pays at every site. A call's route (which implementation, whether it can be replayed from
# a CUDA graph, the plan decoded and agreed across ranks) is worked out on the site's first call
# and kept (``_routes``), so a steady-state call only allocates its outputs and launches.

Impl = Callable[..., Any]
_LIBRARY = torch.library.Library(LIB, "FRAGMENT")


@dataclasses.dataclass(frozen=True)
class Route:
    """How a site's calls run on a device. ``graphable``: ``impl`` writes into the outputs it is
    handed (``out=`` / ``outs=``) with stream work only, so runtime.op_graphs may replay it from a
    CUDA graph; ``check_errors()`` raises a failure an earlier call recorded on the device."""

    impl: Impl
    graphable: bool = False
    check_errors: Callable[[], None] | None = None


# (template, op, group name, device, plan json) -> Route; plans are immutable JSON text
_routes: dict[tuple, tuple[Route, Any]] = {}


def kernels_or_reference(package: str, reference: Any, errors_check: str | None = "check_errors") -> tuple[Callable, Callable]:
    """(route, route_allgather) for the op definers below: the template's ``<package>.kernels``
    (imported on first use, graphable) where its ``usable(group_name, device, plan)`` returns None,
    else its reference."""
    import importlib

    def route_for(entry: str) -> Callable:
        def route(group_name: str, device: torch.device, plan: Any) -> Route:
            kernels = importlib.import_module(f"{package}.kernels")
            if kernels.usable(group_name, device, plan) is not None:
                return Route(getattr(reference, entry))
            check = getattr(kernels, errors_check) if errors_check else None
            return Route(getattr(kernels, entry), graphable=True,
                         check_errors=(lambda: check(device, synchronize=False)) if check else None)

        return route

    return route_for("run"), route_for("run_allgather")


def _route(template: str, op: str, group_name: str, device: torch.device, plan_json: str, parse: Callable,
           route: Callable | None, reference: Impl, check_inputs: Callable[[Any], None]) -> tuple[Route, Any]:
    """The site's route and plan; on its first call the inputs are checked against the plan and
    the ranks' plans compared (runtime.agreement). A rank whose inputs or plan fail there posts
    its error first, so the other ranks raise at once instead of waiting for it."""
    key = (template, op, group_name, device, plan_json)
    hit = _routes.get(key)
    if hit is not None:
        check_inputs(hit[1])
        return hit
    from ..runtime.agreement import check_plan_agreement, report_failure

    try:
        plan = parse(plan_json)
        check_inputs(plan)
    except Exception as e:
        report_failure(group_name, plan_json, template, e)
        raise
    check_plan_agreement(group_name, plan_json, template)
    chosen = route(group_name, device, plan) if (route is not None and device.type == "cuda") else Route(reference)
    if chosen.graphable:
        from .. import config

        if not config.current().op_graphs:
            chosen = dataclasses.replace(chosen, graphable=False)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _routes[key] = (chosen, plan)  # inside a capture the agreement check could not run yet
    return chosen, plan


def clear_routes() -> None:
    """Forget every site's route (tests; after an option such as ``op_graphs`` changed)."""
    _routes.clear()


def define_gemm_collective_op(template: str, out_shape: Callable[[GemmCollectivePlan], Sequence[int]],
                              reference: Impl, route: Callable | None = None) -> Any:
    """Register ``overlap_compile::<template>_gemm_collective(a, b, bias, group_name, plan)``.
    ``route(group_name, device, plan) -> Route`` picks the implementation of CUDA calls."""
    name = f"{template}_gemm_collective"
    _LIBRARY.define(f"{name}(Tensor a, Tensor b, Tensor? bias, str group_name, str plan) -> Tensor")

    def op(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str, plan: str) -> torch.Tensor:
        how, p = _route(template, "gemm_collective", group_name, a.device, plan, GemmCollectivePlan.from_json, route,
                        reference, lambda p: _check_gemm_inputs(template, p, a, b, bias))
        if not how.graphable:
            return how.impl(a, b, bias, group_name, p)
        from ..runtime import op_graphs

        out = a.new_empty(tuple(out_shape(p)))
        op_graphs.run((template, group_name, plan), a.device, (a, b, bias), (out,),
                      lambda: how.impl(a, b, bias, group_name, p, out=out), how.check_errors)
        return out

    def fake(a, b, bias, group_name, plan):
        return a.new_empty(tuple(out_shape(GemmCollectivePlan.from_json(plan))))

    _register(name, op, fake)
    return getattr(torch.ops.overlap_compile, name).default


def define_allgather_gemm_op(template: str, reference: Impl, route: Callable | None = None) -> Any:
    """Register ``overlap_compile::<template>_allgather_gemm(shard, bs, biases, group_name, plan)``
    returning ``[gathered [m, k], out_0 [m, n_0], ...]``."""
    name = f"{template}_allgather_gemm"
    _LIBRARY.define(f"{name}(Tensor shard, Tensor[] bs, Tensor?[] biases, str group_name, str plan) -> Tensor[]")

    def op(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None], group_name: str,
           plan: str) -> list[torch.Tensor]:
        how, p = _route(template, "allgather_gemm", group_name, shard.device, plan, AllGatherGemmPlan.from_json,
                        route, reference, lambda p: _check_allgather_inputs(template, p, shard, bs, biases))
        if not how.graphable:
            return how.impl(shard, bs, biases, group_name, p)
        from ..runtime import op_graphs

        outs = [shard.new_empty(p.m, p.k)] + [shard.new_empty(p.m, n) for n in p.ns]
        op_graphs.run((template, group_name, plan), shard.device, (shard, *bs, *biases), outs,
                      lambda: how.impl(shard, bs, biases, group_name, p, outs=outs), how.check_errors)
        return outs

    def fake(shard, bs, biases, group_name, plan):
        p = AllGatherGemmPlan.from_json(plan)
        return [shard.new_empty(p.m, p.k)] + [shard.new_empty(p.m, n) for n in p.ns]

    _register(name, op, fake)
    return getattr(torch.ops.overlap_compile, name).default


# op name -> the Python kernel registered for it: an op's kernel that calls another template op
# (templates/bucketed.py) calls this directly, without a second trip through the dispatcher
# (5-9 us of host time per call)
KERNELS: dict[str, Impl] = {}


def _register(name: str, kernel: Impl, fake: Impl) -> None:
    KERNELS[name] = kernel
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, kernel, key)
    torch.library.register_fake(f"{LIB}::{name}", fake, lib=_LIBRARY)


def _check_allgather_inputs(template: str, p: AllGatherGemmPlan, shard: torch.Tensor, bs: list[torch.Tensor],
                            biases: list[torch.Tensor | None]) -> None:
    if tuple(shard.shape) != (p.m // p.world, p.k):
        raise ValueError(f"{template}: shard shape {tuple(shard.shape)} != plan's {(p.m // p.world, p.k)}")
    if len(bs) != len(p.ns) or len(biases) != len(p.ns):
        raise ValueError(f"{template}: {len(bs)} weights / {len(biases)} biases for {len(p.ns)} GEMMs in the plan")
    for b, bias, n, has_bias in zip(bs, biases, p.ns, p.has_bias):
        if tuple(b.shape) != (p.k, n):
            raise ValueError(f"{template}: weight shape {tuple(b.shape)} != plan's {(p.k, n)}")
        if (bias is not None) != has_bias or (bias is not None and tuple(bias.shape) != (n,)):
            raise ValueError(f"{template}: bias {None if bias is None else tuple(bias.shape)} does not match "
                             f"the plan (has_bias={has_bias}, n={n})")


def _check_gemm_inputs(template: str, p: GemmCollectivePlan, a: torch.Tensor, b: torch.Tensor,
                       bias: torch.Tensor | None) -> None:
    if tuple(a.shape) != (p.m, p.k) or tuple(b.shape) != (p.k, p.n):
        raise ValueError(
            f"{template}: operands {tuple(a.shape)} @ {tuple(b.shape)} do not match the plan's "
            f"({p.m}, {p.k}) @ ({p.k}, {p.n})"
        )
    if (bias is not None) != p.has_bias:
        raise ValueError(f"{template}: bias given={bias is not None} but plan says has_bias={p.has_bias}")


def gemm_tile(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, rows: Any, cols: Any) -> torch.Tensor:
    """One output block of ``a @ b + bias`` computed with fp32 accumulation, cast back to a's dtype
    (what a tensor-core GEMM tile does). ``rows``/``cols`` index a and b."""
    acc = a[rows].float() @ b[:, cols].float()
    if bias is not None:
        acc = acc + bias[cols].float()
    return acc.to(a.dtype)
