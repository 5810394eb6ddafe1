"""benchmarks/nocomm.py, the comm-free bound of the e2e benchmark: the replacement pass on a traced
graph holding every collective (shapes and dtypes of the real collectives' outputs, no collective
left, the local ops' values), its chaining and cache key, and on CPU over gloo (world 2) a
Llama block compiled under it: no collective in the generated forward or backward code, the
output shape of the real model, and e2e.py's nocomm rows."""
import collections

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks import e2e, nocomm
from overlap_compile.testing.fake_group import fake_process_group
from overlap_compile.testing.multiprocess import run_distributed

c10d = torch.ops._c10d_functional
W = 4


def _all_collectives(group: str):
    def f(x):
        return (c10d.wait_tensor(c10d.all_gather_into_tensor(x, W, group)),
                c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", W, group)),
                c10d.wait_tensor(c10d.all_reduce(x, "sum", group)),
                c10d.wait_tensor(c10d.all_to_all_single(x, [2] * W, [2] * W, group)),
                c10d.wait_tensor(c10d.all_to_all_single(x, [1, 2, 3, 4], [2] * W, group)))  # uneven splits
    return f


def _collective_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and nocomm._collective(n.target)]


def test_replacement_keeps_every_collectives_output_shape_and_dtype():
    x = torch.randn(8, 3, dtype=torch.bfloat16)
    with fake_process_group(W) as group:
        gm = make_fx(_all_collectives(group), tracing_mode="fake")(torch.empty(8, 3, dtype=torch.bfloat16))
        real = [n.meta["val"] for n in gm.graph.nodes if n.target == c10d.wait_tensor.default]
        assert len(real) == 5 and len(_collective_nodes(gm)) == 10
        replaced = nocomm.replace_collectives(gm.graph)
        gm.recompile()
    assert replaced == collections.Counter(all_gather_into_tensor=1, reduce_scatter_tensor=1, all_reduce=1,
                                           all_to_all_single=2)
    assert _collective_nodes(gm) == []
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    fakes = [n.meta["val"] for n in out_node.args[0]]
    outs = gm(x)
    for want, fake, got in zip(real, fakes, outs):
        assert (fake.shape, fake.dtype) == (want.shape, want.dtype)
        assert (got.shape, got.dtype, got.is_contiguous()) == (want.shape, want.dtype, True)
    gathered, chunk, reduced, a2a, uneven = outs
    assert torch.equal(gathered, x.repeat(W, 1))  # W copies of the local shard
    assert torch.equal(chunk, x[:2])  # rank 0's chunk of dim 0
    assert torch.equal(reduced, x) and reduced.data_ptr() != x.data_ptr()  # a copy: a real kernel runs
    assert torch.equal(a2a, x) and torch.equal(uneven, torch.cat([x, x[:2]]))


def test_autograd_twins_are_collectives_too():
    # torch 2.11's functional collectives with autograd are ops of their own namespace
    if not hasattr(torch.ops._c10d_functional_autograd, "all_gather_into_tensor"):
        pytest.skip("this torch has no _c10d_functional_autograd ops")
    ops = torch.ops._c10d_functional_autograd
    assert nocomm._collective(ops.all_gather_into_tensor.default) == "all_gather_into_tensor"
    assert nocomm._collective(ops.reduce_scatter_tensor.default) == "reduce_scatter_tensor"
    assert nocomm._collective(torch.ops.aten.mm.default) is None


def test_unknown_collective_raises():
    with fake_process_group(W) as group:
        gm = make_fx(lambda x: c10d.all_gather_into_tensor_coalesced([x], W, group)[0], tracing_mode="fake")(
            torch.empty(8, 3))
        with pytest.raises(NotImplementedError, match="all_gather_into_tensor_coalesced"):
            nocomm.replace_collectives(gm.graph)


def test_eager_all_reduce_is_local_inside_the_wrapped_call_only():
    """The bound's stand-in for a gradient sync outside the compiled graphs: torch.distributed's
    all_reduce does nothing (no process group here, so the real one would raise) and is counted,
    and is the real one again afterwards."""
    import collections

    import torch.distributed as dist

    real = dist.all_reduce
    t = torch.arange(4.0)
    replaced = collections.Counter()

    def sync():
        dist.all_reduce(t)
        dist.all_reduce(t, group=None)
        return "done"

    assert nocomm.without_eager_all_reduce(sync, replaced)() == "done"
    assert replaced == {"all_reduce (eager)": 2} and torch.equal(t, torch.arange(4.0))
    assert dist.all_reduce is real


    def fails():
        dist.all_reduce(t)
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        nocomm.without_eager_all_reduce(fails, replaced)()
    assert dist.all_reduce is real and replaced == {"all_reduce (eager)": 3}


class _Recorder(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, key: str) -> None:
        self.key, self.seen = key, []

    def __call__(self, graph) -> None:
        self.seen.append(len(_collective_nodes_graph(graph)))

    def uuid(self):
        return self.key


def _collective_nodes_graph(graph):
    return [n for n in graph.nodes if n.op == "call_function" and nocomm._collective(n.target)]


def test_pass_chains_the_installed_pass_first_and_keys_the_cache_on_it():
    from torch._inductor import config as inductor_config

    before = _Recorder("a")
    with fake_process_group(W) as group:
        gm = make_fx(_all_collectives(group), tracing_mode="fake")(torch.empty(8, 3))
        with inductor_config.patch({"post_grad_custom_post_pass": before}), nocomm.nocomm() as p:
            assert inductor_config.post_grad_custom_post_pass is p
            p(gm.graph)
            uuid_a = p.uuid()
        assert before.seen == [10], "the installed pass runs first, on the graph with its collectives"
        assert p.replaced["all_to_all_single"] == 2 and _collective_nodes(gm) == []
        with inductor_config.patch({"post_grad_custom_post_pass": _Recorder("b")}), nocomm.nocomm() as p2:
            assert p2.uuid() != uuid_a


# ---- CPU, gloo, world 2 ------------------------------------------------------------------------------


def _compiled_code_and_rows(args: dict):
    """On every rank: the DTensor block compiled under nocomm (forward + backward code), the same
    block's eager output shape, then e2e.py's sweep with the nocomm variant."""
    from torch._inductor.utils import run_and_get_code

    from benchmarks.models import build

    built = build("llama_dtensor", e2e.CPU_SHAPES["tiny"], "cpu", torch.float32, seed=0)
    want = built.to_local(built.model(built.x)).shape
    torch._dynamo.reset()
    with nocomm.nocomm() as p:
        fn = torch.compile(built.model)

        def step():
            y = built.to_local(fn(built.x))
            y.float().pow(2).mean().backward()
            return y

        y, code = run_and_get_code(step)
    torch._dynamo.reset()
    return list(code), tuple(y.shape), tuple(want), dict(p.replaced), e2e.worker(args)


@pytest.fixture(scope="module")
def gloo_results():
    a = e2e.parse(["--dry-run", "--models", "llama70_dtensor", "--shapes", "tiny", "--variants", "default,nocomm,nocomm_nopad",
                   "--steps", "2", "--iters", "1", "--check-cache", "off", "--no-check-models"])
    a.out = None
    return run_distributed(_compiled_code_and_rows, world_size=2, args=(vars(a),), timeout_s=600)


def test_nocomm_compiled_block_has_no_collective_and_the_real_output_shape(gloo_results):
    for code, got, want, replaced, _ in gloo_results:
        assert len(code) >= 2, "forward and backward were compiled"
        text = "\n".join(code)
        assert "_c10d_functional" not in text, "a collective is left in the generated code"
        assert "oc_nocomm.repeat_rows" in text and "oc_nocomm.chunk_rows" in text
        assert got == want
        # forward: 2 all-gathers + 2 reduce-scatters; backward mirrors them
        assert replaced == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}, replaced


def test_e2e_nocomm_rows(gloo_results):
    rows = e2e.compare(gloo_results[0][4], 1e-4)
    assert [r.get("error") for r in rows] == [None, None, None], [r.get("error") for r in rows]
    by = {r["variant"]: r for r in rows}
    assert "a dense block has none" in by["nocomm_nopad"]["skipped"] and "ms" not in by["nocomm_nopad"]
    # llama70_dtensor named alone runs its own (dry-run stand-in) shape, whatever --shapes said
    assert {r["model"] for r in rows} == {"llama70_dtensor"} and by["nocomm"]["shape"] == e2e.CPU_SHAPES["tiny-70b"]["name"]
    bound = by["nocomm"]
    assert (bound["method"], bound["mode"]) == ("nocomm", "eager") and bound["train_ms"] > 0 and bound["prefill_ms"] > 0
    assert bound["nocomm_replaced"]["all_gather_into_tensor"] > 0 and bound["nocomm_replaced"]["reduce_scatter_tensor"] > 0
    assert bound["nocomm_standins"] == nocomm.STANDINS  # which stand-ins this bound ran
    assert len(bound["losses"]) == 2 and "loss_matches_default" not in bound  # its losses are not compared
    ok, notes = e2e.verdict(rows, 1e-4)
    assert ok, notes
