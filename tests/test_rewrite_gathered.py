"""An all-gather site whose gathered matrix only its GEMMs read gets a plan with
``gathered: false`` (passes/rewrite.py), so p2p_ring's copy-engine path skips copying the shards
into that output; a site whose gathered matrix is also read elsewhere (returned, as a saved
activation would be) keeps ``gathered: true``. Traced on a fake group of 2 ranks, p2p_ring forced."""
import json

import torch

from overlap_compile import config
from overlap_compile.passes.pipeline import run_on_graph
from overlap_compile.testing.fake_group import fake_process_group
from tests import graph_cases as gc


def _plans(case, **kwargs) -> list[dict]:
    with fake_process_group(2) as group:
        fn, shapes = case(group, 2, **kwargs)
        gm = gc.trace(fn, [torch.randn(s) for s in shapes])
        with config.patch(force_template="p2p_ring"):
            record = run_on_graph(gm.graph, config.current())
        assert record.sites[0].rewritten, record.sites[0].reason
        nodes = [n for n in gm.graph.nodes if "p2p_ring_allgather_gemm" in str(n.target)]
        assert len(nodes) == 1
        readers = sorted(u.args[1] for u in nodes[0].users)  # getitem indices still read
        return json.loads(nodes[0].args[-1]), readers


def test_gathered_matrix_only_read_by_its_gemms_is_not_written():
    plan, readers = _plans(gc.allgather_gemm_batch1, views=3)
    assert plan["gathered"] is False
    assert 0 not in readers and readers == [1, 2, 3]


def test_gathered_matrix_read_elsewhere_is_kept():
    plan, readers = _plans(gc.allgather_gemm_dim0)  # returns the gathered matrix too
    assert plan["gathered"] is True
    assert readers == [0, 1, 2]


def _found_plan(case, **kwargs) -> dict:
    """The p2p_ring plan of the case's site as the decision builds it, before any rewrite: what
    settle and the predictor time."""
    from overlap_compile import templates
    from overlap_compile.passes.find import find

    with fake_process_group(2) as group:
        fn, shapes = case(group, 2, **kwargs)
        gm = gc.trace(fn, [torch.randn(s) for s in shapes])
        (match,) = [m for m in find(gm.graph) if m.kind == "allgather_gemm"]
        spec = templates.get_spec("p2p_ring")
        return json.loads(spec.plan(match, spec.default_config(match), 1000).to_json()), match


def test_the_site_is_timed_as_it_will_run():
    """Before the rewrite, the match already knows whether the gathered matrix is read beyond
    its GEMMs: the plan settle times writes it out only where the graph reads it, and the two
    forms are different sites to the caches."""
    alone, m_alone = _found_plan(gc.allgather_gemm_batch1, views=3)
    read, m_read = _found_plan(gc.allgather_gemm_dim0)
    assert alone["gathered"] is False and read["gathered"] is True
    assert "gathered=False" in m_alone.signature() and "gathered=True" in m_read.signature()
