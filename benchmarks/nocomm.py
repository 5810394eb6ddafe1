"""The comm-free bound of the end-to-end benchmark (e2e.py's ``nocomm`` variant; also moe.py's): the same model
under the same torch.compile, with every collective in Inductor's post-grad graphs replaced by a
local op of the same output shape and dtype, so the ranks run exactly the compute Inductor
compiles and nothing else.

    with nocomm() as p:            # default backend; any post-grad custom pass already set is chained
        torch.compile(model)(x)
    p.replaced                     # Counter: collective name -> sites replaced, over every graph

Replacements (``_c10d_functional`` and, where torch has them, ``_c10d_functional_autograd``):

    all_gather_into_tensor(x, n, g)         -> oc_nocomm.repeat_rows(x, n)     n copies of the shard (one cat)
    reduce_scatter_tensor(x, op, n, g)      -> oc_nocomm.chunk_rows(x, n, r)   this rank's chunk r of dim 0
    all_reduce(x, op, g), broadcast(x, s, g) -> oc_nocomm.copy(x)
    all_to_all_single(x, out, in, g)        -> oc_nocomm.take_rows(x, out)     sum(out) rows (x's, cycled)
    wait_tensor(t)                          -> t

A step may also communicate outside the compiled graphs, where the pass cannot see: a hand-written
model's gradient sync between backward and the optimizer (benchmarks/models/common.py's
finalize_grads). ``without_eager_all_reduce(fn, p.replaced)`` runs it with torch.distributed.all_reduce
a no-op, counted as ``"all_reduce (eager)"``; the flattening and copying around the collective stay.

The local ops are custom ops, so Inductor treats them as it treats a collective: an opaque kernel
writing a fresh contiguous buffer that the neighbours cannot fuse into. Plain aten clones would be
fused away by Inductor (a clone is an inlinable pointwise), and the bound would then also credit
fusions the real graph cannot make. What is left over the real graph is one copy kernel per
collective (tens of microseconds at the e2e shapes). Any other collective in a graph raises: a bound
with communication left in it would be wrong without saying so.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")  # the latter: torch 2.11's autograd forms
# which stand-ins a bound ran, kept on its rows (``nocomm_standins``): 1, rows without the key, ran
# each all-gather's as Tensor.repeat (a strided copy at a third of the copy bandwidth); 2: one cat
STANDINS = 2


def _define_ops() -> Any:
    """oc_nocomm::* (once per process). The library object must outlive the module's import."""
    if hasattr(torch.ops, "oc_nocomm") and hasattr(torch.ops.oc_nocomm, "copy"):
        return None  # imported a second time under another module name
    lib = torch.library.Library("oc_nocomm", "DEF")
    lib.define("repeat_rows(Tensor x, int n) -> Tensor")
    lib.define("chunk_rows(Tensor x, int n, int index) -> Tensor")
    lib.define("copy(Tensor x) -> Tensor")
    lib.define("take_rows(Tensor x, SymInt[] rows) -> Tensor")

    def rows_like(x: torch.Tensor, rows: Any) -> torch.Tensor:
        return x.new_empty((rows, *x.shape[1:]))

    def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        want = sum(rows)
        if want == x.shape[0]:
            return x.clone(memory_format=torch.contiguous_format)
        if x.shape[0] == 0:
            return x.new_zeros((want, *x.shape[1:]))
        reps = math.ceil(want / x.shape[0])
        return x.repeat(reps, *[1] * (x.dim() - 1))[:want].contiguous()

    impls = {
        # one batched copy of contiguous pieces: Tensor.repeat's strided copy runs at a third of
        # the bandwidth (benchmarks/diagnostics/standin_copies.py), a bound short by that much more
        "repeat_rows": lambda x, n: torch.cat([x] * n),
        "chunk_rows": lambda x, n, index: x[index * (x.shape[0] // n):(index + 1) * (x.shape[0] // n)].clone(
            memory_format=torch.contiguous_format),
        "copy": lambda x: x.clone(memory_format=torch.contiguous_format),
        "take_rows": take_rows,
    }
    fakes = {
        "repeat_rows": lambda x, n: rows_like(x, n * x.shape[0]),
        "chunk_rows": lambda x, n, index: rows_like(x, x.shape[0] // n),
        "copy": lambda x: rows_like(x, x.shape[0]),
        "take_rows": lambda x, rows: rows_like(x, sum(rows)),
    }
    for name, fn in impls.items():
        lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"oc_nocomm::{name}", fakes[name], lib=lib)
    return lib


_LIB = _define_ops()


def _collective(target: Any) -> str | None:
    """'all_reduce' for _c10d_functional.all_reduce.default (or its autograd twin), else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, _, rest = target.name().partition("::")
    return rest.split(".")[0] if ns in NAMESPACES else None


def _group_rank(group: Any) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    from overlap_compile.passes.graph_utils import group_name_of

    return _resolve_process_group(group_name_of(group)).rank()


def _local_op(name: str, node: fx.Node) -> tuple[Any, tuple] | None:
    """(local op, its args) standing for the collective ``node``, or None when not one we know."""
    ops = torch.ops.oc_nocomm
    a = node.args
    if name == "all_gather_into_tensor":  # (x, group_size, group)
        return ops.repeat_rows.default, (a[0], a[1])
    if name == "reduce_scatter_tensor":  # (x, reduce_op, group_size, group)
        return ops.chunk_rows.default, (a[0], a[2], _group_rank(a[3]))
    if name in ("all_reduce", "broadcast"):  # (x, op | src, group)
        return ops.copy.default, (a[0],)
    if name == "all_to_all_single":  # (x, output_split_sizes, input_split_sizes, group)
        return ops.take_rows.default, (a[0], list(a[1]))
    return None


def replace_collectives(graph: fx.Graph) -> collections.Counter:
    """Replace every functional collective of ``graph`` in place; returns name -> count."""
    from overlap_compile.passes.graph_utils import GraphEmitter

    replaced: collections.Counter = collections.Counter()
    for node in list(graph.nodes):
        name = _collective(node.target) if node.op == "call_function" else None
        if name is None:
            continue
        if name == "wait_tensor":  # its collective is already local: the tensor itself
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        local = _local_op(name, node)
        if local is None:
            raise NotImplementedError(f"nocomm: no local stand-in for {node.target} (node {node.name}); "
                                      "the comm-free bound would keep its communication")
        op, args = local
        new = GraphEmitter(graph, node)(op, *args)
        new.meta["nocomm"] = name
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[name] += 1
    return replaced


def _as_list(passes: Any) -> list[Any]:
    from overlap_compile.inductor_hook import _as_list as as_list

    return as_list(passes)


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class NoCommPass(CustomGraphPass):
    """Inductor post-grad custom pass: the passes installed before run first, then the replacement."""

    def __init__(self, chained: Any = None) -> None:
        self.chained = [p for p in _as_list(chained) if not isinstance(p, NoCommPass)]
        self.replaced: collections.Counter = collections.Counter()

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.chained:
            p(graph)
        self.replaced.update(replace_collectives(graph))

    def __deepcopy__(self, memo: dict) -> "NoCommPass":
        # Inductor deep-copies its config: the copy must count into the same ``replaced``
        return self

    def uuid(self) -> Any:
        import torch.distributed as dist

        # the rank is in the key: chunk_rows takes the rank's own chunk, so ranks' graphs differ
        rank = dist.get_rank() if dist.is_initialized() else 0
        parts = [_source_hash(), torch.__version__, str(rank)]
        for p in self.chained:
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # a plain callable cannot be keyed: Inductor bypasses the cache
            parts.append(u.hex() if isinstance(u, bytes) else str(u))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


@contextlib.contextmanager
def nocomm() -> Iterator[NoCommPass]:
    """Graphs compiled inside run without communication (see the module docstring)."""
    from torch._inductor import config as inductor_config

    p = NoCommPass(chained=inductor_config.post_grad_custom_post_pass)
    with inductor_config.patch({"post_grad_custom_post_pass": p}):
        yield p


EAGER_ALL_REDUCE = "all_reduce (eager)"


def without_eager_all_reduce(fn: Callable[[], Any], replaced: collections.Counter) -> Callable[[], Any]:
    """``fn`` with torch.distributed.all_reduce a no-op while it runs, each call it makes counted in
    ``replaced[EAGER_ALL_REDUCE]``: the bound's stand-in for a step's collectives outside the
    compiled graphs (the tensor keeps this rank's values, as oc_nocomm.copy does in a graph)."""
    import torch.distributed as dist

    def local(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        replaced[EAGER_ALL_REDUCE] += 1

    @functools.wraps(fn)
    def run() -> Any:
        real, dist.all_reduce = dist.all_reduce, local
        try:
            return fn()
        finally:
            dist.all_reduce = real

    return run
