"""``plan``: what the overlap pass would do to a model, without running it on GPUs.

    with fake_process_group(8) as group:                 # overlap_compile.testing.fake_group
        block = MyTPBlock(group).to("meta", torch.bfloat16)
        x = torch.empty(1, 1024, 8192, device="meta", dtype=torch.bfloat16, requires_grad=True)
        report = oc.plan(block, x, backward=True, mode="reduce-overhead", profile="h200")
    print(report)                                        # every site, decision and reason

The model is traced as ``torch.compile`` does (Dynamo, AOTAutograd, post-grad passes with the
overlap pass) but code generation is skipped, so meta tensors and a fake group plan any size on a
CPU. Decisions match a GPU compile with the same profile, world size and ``mode``, except nothing
is measured (uncertain sites keep their prediction). Keyword arguments are options, as for ``explain``.
"""
from __future__ import annotations

from typing import Any

import torch

from . import config as oc_config
from .compile_caches import no_compile_caches
from .explain import _sum_outputs
from .report import Report


def plan(model: Any, *inputs: Any, backward: bool = False, mode: str | None = None, **overrides: Any) -> Report:
    from torch._inductor import config as inductor_config

    from .inductor_hook import inductor_patches, make_pass

    report = Report()
    with oc_config.patch(**overrides) as opts:
        patches = inductor_patches(make_pass(opts, report))
        if mode and mode != "default":
            patches.update(torch._inductor.list_mode_options(mode))
        with inductor_config.patch(patches), no_compile_caches():
            # static shapes: a recompile of the same code (another size) must not turn them symbolic
            out = torch.compile(model, backend=_planning_backend(), dynamic=False)(*inputs)
            if backward:
                loss = _sum_outputs(out)
                if loss is None:
                    raise ValueError("plan(backward=True): the model returned no tensor that requires grad")
                loss.backward()
    return report


def _planning_backend() -> Any:
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(fw_compiler=_post_grad(False), bw_compiler=_post_grad(False),
                        inference_compiler=_post_grad(True), decompositions=select_decomp_table(),
                        partition_fn=_partition_fn())


def _partition_fn() -> Any:
    """Inductor's partitioner (min-cut rematerialisation). Inductor's joint-graph passes, which its
    own partition function runs first, are left out: on meta inputs they leave a node the
    partitioner can neither save nor recompute (torch 2.13)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition


def _post_grad(is_inference: bool) -> Any:
    """A graph compiler that runs Inductor's post-grad passes (the overlap pass among them) and
    returns the graph itself, to run on whatever its inputs are (meta tensors included)."""
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from functorch.compile import make_boxed_func
        from torch._guards import detect_fake_mode
        from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
        from torch._inductor.virtualized import V

        view_to_reshape(gm)  # as compile_fx does before the post-grad passes
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            post_grad_passes(gm, is_inference=is_inference)
        gm.recompile()
        return make_boxed_func(gm)

    return compile_graph
