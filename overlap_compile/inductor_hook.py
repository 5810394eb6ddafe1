"""The Inductor post-grad pass, and ``enable()`` for the default inductor backend.

``OverlapPass`` is a ``CustomGraphPass``: its ``uuid()`` is a hash of overlap_compile's sources,
the options snapshot and any chained pass's uuid, so the FX graph cache keeps hitting and is
invalidated when any of them changes. A post-grad custom pass the user installed before is
chained (run first), never replaced; torch 2.11 holds one pass, 2.13 may hold a list: both work.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import config as oc_config
from .report import Report, global_report


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith((".py", ".json")):
                path = os.path.join(dirpath, f)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def _as_list(passes: Any) -> list[Any]:
    if passes is None:
        return []
    if isinstance(passes, (list, tuple)):
        return list(passes)
    return [passes]


class OverlapPass(CustomGraphPass):
    def __init__(self, options: oc_config.Options, report: Report | None = None, chained: Any = None) -> None:
        self.options = options
        self.report = report
        self.chained = [p for p in _as_list(chained) if not isinstance(p, OverlapPass)]
        self.records: list = []  # every graph this pass ran on, in order (the backend reads its own)

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.chained:
            p(graph)
        if not self.options.enabled:
            return
        from .passes.pipeline import run_on_graph

        record = run_on_graph(graph, self.options)
        self.records.append(record)
        for r in {id(x): x for x in (self.report, global_report()) if x is not None}.values():
            r.add(record)
        if self.options.dump_dir:
            one = Report()
            one.add(record)
            one.dump(os.path.join(self.options.dump_dir, record.name + f"_{id(graph):x}"))

    def __deepcopy__(self, memo: dict) -> "OverlapPass":
        # Inductor deep-copies its config (and so this pass). The copy must keep feeding the same
        # Report, and the options are immutable: sharing is the correct copy.
        return self

    def uuid(self) -> Any:
        from . import predictor

        # A profile JSON outside the package is not in the source hash: key on its content too.
        profile_key = getattr(predictor.load_profile(self.options.profile), "key", "")
        return _keyed([_source_hash(), self.options.to_json(), torch.__version__, str(profile_key)], self.chained)


def _keyed(parts: list[str], chained: list[Any]) -> str | None:
    """The cache key of a pass: ``parts`` and every chained pass's own key (None where one has
    none: a plain callable cannot be keyed, so Inductor bypasses its cache)."""
    for p in chained:
        u = p.uuid() if hasattr(p, "uuid") else None
        if u is None:
            return None
        parts = parts + [u.hex() if isinstance(u, bytes) else str(u)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


class RecomputeZerosPass(CustomGraphPass):
    """Inductor's ``joint_custom_post_pass`` where moe_scatter is on: the passes the user had
    there (``chained``, run first), then passes/recompute_zeros.py on the joint graph."""

    def __init__(self, chained: Any = None) -> None:
        self.chained = [p for p in _as_list(chained) if not isinstance(p, RecomputeZerosPass)]

    def __call__(self, graph: fx.Graph) -> None:
        from .passes.recompute_zeros import mark_zeros_for_recompute

        for p in self.chained:
            p(graph)
        mark_zeros_for_recompute(graph)

    def __deepcopy__(self, memo: dict) -> "RecomputeZerosPass":
        return self  # stateless but for the chained passes, which Inductor's copy would share too

    def uuid(self) -> Any:
        return _keyed([_source_hash(), "recompute_zeros"], self.chained)


def make_pass(options: oc_config.Options | None = None, report: Report | None = None) -> OverlapPass:
    from torch._inductor import config as inductor_config

    return OverlapPass(options or oc_config.current(), report, chained=inductor_config.post_grad_custom_post_pass)


def inductor_patches(p: OverlapPass) -> dict[str, Any]:
    """The Inductor config a compile with pass ``p`` runs under: the pass itself; where the pass is
    on, no shape padding; where it may move compute under collectives (passes/defer_compute.py),
    no peak-memory reordering, which would put that compute back before the collectives; and
    where MoE buffers are filled by moe_scatter, RecomputeZerosPass on the joint graph, so the
    backward's buffer is provably zeros and moe_scatter takes it too.

    Shape padding (pad_mm) is off because it pads a GEMM where a benchmark on this rank finds that
    faster: the graph the finder sees would depend on a timing that can differ per rank and run,
    yet every rank must find and decide the same sites."""
    from torch._inductor import config as inductor_config

    patches: dict[str, Any] = {"post_grad_custom_post_pass": p}
    if p.options.enabled:
        patches["shape_padding"] = False
    if p.options.fills_moe_buffers:  # the backward's MoE buffers start from zeros of their own
        patches["joint_custom_post_pass"] = RecomputeZerosPass(inductor_config.joint_custom_post_pass)
    if p.options.moves_compute:
        patches["reorder_for_peak_memory"] = False
    return patches


@contextlib.contextmanager
def enable(report: Report | None = None, **overrides: Any) -> Iterator[OverlapPass]:
    """Run the overlap pass under the default inductor backend inside this block.

    The options in effect at entry (plus ``overrides``) govern every graph compiled inside,
    including the backward graphs: AOTAutograd normally compiles backward lazily, at the first
    ``.backward()``, possibly outside this block and on another thread, so inside the block it
    is told to compile backward together with forward.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with oc_config.patch(**overrides) as opts:
        p = make_pass(opts, report)
    patches = inductor_patches(p)
    eager_bw = {"force_non_lazy_backward_lowering": True} if hasattr(functorch_config, "force_non_lazy_backward_lowering") else {}
    with inductor_config.patch(patches), functorch_config.patch(eager_bw):
        yield p
