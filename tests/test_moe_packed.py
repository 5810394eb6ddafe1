"""moe_fused with ``"experts": "packed"`` (templates/moe_fused/packed.py): the expert GEMMs on the
routed rows only, sizes on the device.

- the index maps (gather_index, unpack_index) against a Python loop, empty and full groups;
- move_rows (torch path, and the Triton kernel through the interpreter in a subprocess) against
  indexing, strided sources and destinations, -1 rows zero;
- silu_mul_unpack (the forward's elementwise step with the unpack of the saves, one pass) against
  silu_mul and three move_rows, into column blocks of a wider saved layout, both paths;
- the forward experts against reference.experts (bmm on every slot) on slots with zero tails of
  every length (none, some, all rows routed), the intermediates kept into column blocks of the
  saved layout;
- the backward's PackedPieces against backward_reference.Pieces on W sources' gradient pieces with zero
  tails: every d_h piece and the three weight gradients (grouped over K at each expert's rows,
  every source packed expert by expert);
- a training step of demo.moe's layer at W = 2 over gloo with the packed config forced: both
  sections rewritten, every gradient equal to the eager layer's (fp32)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.interpreter import run_interpreted

from overlap_compile.templates.moe_fused import packed as P
from overlap_compile.templates.moe_fused import reference as ref

PACKED = {"split": "source", "transport": "p2p", "experts": "packed"}


def _gather_loop(sizes, starts, length):
    rows = [s + i for n, s in zip(sizes, starts) for i in range(n)]
    return rows + [-1] * (length - len(rows))


@pytest.mark.parametrize("sizes", [[3, 0, 5], [0, 0, 0], [4, 4, 4], [0, 2, 0, 1]])
def test_index_maps_against_a_loop(sizes):
    cap = 4 if max(sizes) <= 4 else 6
    n = torch.tensor(sizes, dtype=torch.int32)
    starts = torch.arange(len(sizes)) * cap
    got = P.gather_index(n, starts, len(sizes) * cap).tolist()
    assert got == _gather_loop(sizes, starts.tolist(), len(sizes) * cap)
    unpack = P.unpack_index(n, cap).tolist()
    want, at = [], 0
    for s in sizes:
        want += [at + i if i < s else -1 for i in range(cap)]
        at += s
    assert unpack == want
    assert P.group_ends(n).tolist() == torch.cumsum(torch.tensor(sizes), 0).tolist()
    # arbitrary segment starts (the backward's per-source segments)
    odd = torch.tensor([7, 1, 20, 13])[:len(sizes)]
    assert P.gather_index(n, odd, sum(sizes) + 3).tolist() == _gather_loop(sizes, odd.tolist(), sum(sizes) + 3)


def check_move_rows() -> None:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 10, 37, generator=g)
    src = full[:, 2:7]  # [3, 5, 37], strided rows and batches
    index = torch.tensor([4, -1, 14, 0, 7, -1, 9])
    flat = src.reshape(-1, 37)
    want = torch.stack([flat[i] if i >= 0 else torch.zeros(37) for i in index.tolist()])
    torch.testing.assert_close(P.move_rows(src, index), want, rtol=0, atol=0)
    dest_full = torch.randn(2, 9, 37, generator=g)
    before = dest_full.clone()
    dest = dest_full[:, 3:7]  # a [2, 4, 37] block of a wider layout: its 8 rows, in order
    index8 = torch.cat([index, torch.tensor([1])])
    P.move_rows(src, index8, out=dest)
    want8 = torch.cat([want, flat[1:2]]).view(2, 4, 37)
    torch.testing.assert_close(dest_full[:, 3:7], want8, rtol=0, atol=0)
    assert torch.equal(dest_full[:, :3], before[:, :3]) and torch.equal(dest_full[:, 7:], before[:, 7:])


def check_piece_maps() -> None:
    """piece_maps' one-launch maps (CUDA, or the interpreter) against gather_index, unpack_index
    and group_ends, on slots with zero tails of every length (groups empty, full, one of one)."""
    g = torch.Generator().manual_seed(4)
    for sizes, cap in (([3, 0, 5, 8], 8), ([0, 0, 0], 5), ([7], 7), ([1, 2, 0, 1, 3], 3), ([2, 1300], 1300)):
        x = _slots(len(sizes), cap, 16, sizes, g)
        n, pack, unpack, offs = P.piece_maps(x)
        assert n.tolist() == sizes
        starts = torch.arange(len(sizes)) * cap
        assert pack.tolist() == P.gather_index(n, starts, len(sizes) * cap).tolist(), sizes
        assert unpack.tolist() == P.unpack_index(n, cap).tolist(), sizes
        assert offs.dtype == torch.int32 and offs.tolist() == P.group_ends(n).tolist(), sizes


def test_piece_maps_torch_path():
    check_piece_maps()


def test_move_rows_torch_path():
    check_move_rows()
    with pytest.raises(ValueError, match="unit column stride"):
        P.move_rows(torch.zeros(4, 6).t(), torch.tensor([0]))
    with pytest.raises(ValueError, match="does not hold"):
        P.move_rows(torch.zeros(4, 6), torch.tensor([0, 1]), out=torch.zeros(3, 6))


def check_silu_mul_unpack() -> None:
    """Packed rows [P 9, F 37] (8 routed, one spare), a piece of E 3 x C 4 slots written as the
    middle column block of [3, 12, 37] saved layouts, sizes 3, 0, 4 (zeros past them); the packed
    act's routed rows are the product, the other blocks of the saved layouts stay as they were."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    e, c, f, sizes = 3, 4, 37, torch.tensor([3, 0, 4])
    gate, up = torch.randn(9, f, generator=g) * 3, torch.randn(9, f, generator=g)
    index = P.unpack_index(sizes, c)
    layouts = [torch.randn(e, 3 * c, f, generator=g) for _ in range(3)]
    before = [t.clone() for t in layouts]
    act = P.silu_mul_unpack(gate, up, index, *(t[:, c:2 * c] for t in layouts))
    want_act = F.silu(gate) * up
    torch.testing.assert_close(act[:7], want_act[:7], rtol=1e-5, atol=1e-5)
    for t, b, packed_rows in zip(layouts, before, (gate, up, want_act)):
        torch.testing.assert_close(t[:, c:2 * c], P.move_rows(packed_rows, index).view(e, c, f), rtol=1e-5, atol=1e-5)
        assert torch.equal(t[:, :c], b[:, :c]) and torch.equal(t[:, 2 * c:], b[:, 2 * c:])
    assert layouts[2][1, c:2 * c].abs().sum() == 0 and layouts[0][0, c + 3].abs().sum() == 0


def test_silu_mul_unpack_torch_path():
    check_silu_mul_unpack()
    with pytest.raises(ValueError, match="one \\[B, R, F\\] layout"):
        P.silu_mul_unpack(torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(6, dtype=torch.long),
                          torch.zeros(2, 3, 6), torch.zeros(2, 3, 6), torch.zeros(3, 2, 6))


def test_move_rows_kernel_under_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("import tests.test_moe_packed as t\n"
            "from overlap_compile.templates.moe_fused import packed as P\n"
            "import torch\n"
            "assert P._use_triton(torch.zeros(1)), 'the interpreter path is not taken'\n"
            "t.check_move_rows()\n"
            "t.check_piece_maps()\n"
            "t.check_silu_mul_unpack()\n"
            "t.check_experts_forward()\n"
            "t.test_backward_pieces_equal_the_bmm_pieces()\n"
            "print('ALL OK')\n")
    run_interpreted(code)


def test_grouped_gemm_fallback_equals_grouped_mm():
    """Where torch._grouped_mm cannot run (rows of 20 bytes here) one mm per group runs: the same
    products, both forms (groups of rows; groups of K), an empty group giving zeros."""
    g = torch.Generator().manual_seed(3)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    a, b = torch.randn(9, 5, generator=g), torch.randn(3, 5, 6, generator=g)
    rows = P.grouped(a, b, offs)
    for j, (lo, hi) in enumerate(((0, 3), (3, 3), (3, 7))):
        torch.testing.assert_close(rows[lo:hi], a[lo:hi] @ b[j])
    k_a, k_b = torch.randn(5, 9, generator=g), torch.randn(9, 6, generator=g)
    by_k = P.grouped(k_a, k_b, offs)
    assert by_k.shape == (3, 5, 6) and torch.equal(by_k[1], torch.zeros(5, 6))
    for j, (lo, hi) in enumerate(((0, 3), (3, 3), (3, 7))):
        torch.testing.assert_close(by_k[j], k_a[:, lo:hi] @ k_b[lo:hi])


def _slots(e, c, h, sizes, g):
    x = torch.randn(e, c, h, generator=g)
    for j, n in enumerate(sizes):
        x[j, n:] = 0
    return x


def check_experts_forward() -> None:
    """Odd sizes (E 3, C 7, H 16, F 24: aligned for the grouped GEMM), zero tails of every length."""
    g = torch.Generator().manual_seed(1)
    e, c, h, f, w = 3, 7, 16, 24, 2
    w1, w3, w2 = torch.randn(e, h, f, generator=g), torch.randn(e, h, f, generator=g), torch.randn(e, f, h, generator=g)
    for sizes in ([7, 0, 3], [0, 0, 0], [7, 7, 7], [1, 5, 2]):
        x = _slots(e, c, h, sizes, g)
        saved = {r: torch.full((e, w * c, f), float("nan")) for r in ("gate", "up", "act")}
        want_saved = {r: torch.full((e, w * c, f), float("nan")) for r in ("gate", "up", "act")}
        keep = {r: t[:, c:2 * c] for r, t in saved.items()}  # source 1's column block
        want = ref.experts(x, w1, w3, w2, keep={r: t[:, c:2 * c] for r, t in want_saved.items()})
        got = ref.experts(x, w1, w3, w2, keep=keep, packed=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for r in saved:
            torch.testing.assert_close(saved[r], want_saved[r], rtol=1e-5, atol=1e-5, equal_nan=True)
        assert all(got[j, n:].abs().sum() == 0 for j, n in enumerate(sizes)), "padding rows are not zero"


def test_experts_forward_equals_bmm_on_every_slot():
    check_experts_forward()


def test_backward_pieces_equal_the_bmm_pieces():
    """W = 3 sources, E 2, C 5, H 16, F 24; each source's gradient piece has zero tails of its own
    lengths (one expert empty in one piece); own piece first, then the peers, then the weight
    gradients, as the rounds call them."""
    import torch.nn.functional as F

    from overlap_compile.templates.moe_fused import backward_reference as bref
    from overlap_compile.templates.plans import MoePlan

    g = torch.Generator().manual_seed(2)
    w, e, c, h, f, rank = 3, 2, 5, 16, 24, 1
    sizes = [[5, 2], [0, 3], [4, 5]]  # per source, per expert
    tokens = torch.cat([_slots(e, c, h, s, g) for s in sizes], 1)  # [E, W*C, H]: source blocks side by side
    w1, w3, w2 = torch.randn(e, h, f, generator=g), torch.randn(e, h, f, generator=g), torch.randn(e, f, h, generator=g)
    gate, up = torch.bmm(tokens, w1), torch.bmm(tokens, w3)
    act = F.silu(gate) * up
    slots = torch.stack([_slots(e, c, h, s, g).reshape(e * c, h) for s in sizes])  # [W, rows, H] gradient pieces
    operands = (tokens.transpose(1, 2), gate, up, act.transpose(1, 2), w1.transpose(1, 2), w3.transpose(1, 2),
                w2.transpose(1, 2))
    results = []
    for config in ({"split": "source"}, PACKED):
        plan = MoePlan("moe_fused", w, e, c, h, f, config, direction="backward")
        out = torch.full((w, e * c, h), float("nan"))
        pieces = bref.make_pieces(slots, out, rank, plan, *operands)
        assert isinstance(pieces, bref.PackedPieces) == (config is PACKED)
        pieces.own()
        peers = {src: pieces.peer(src, slots[src].clone()) for src in range(w) if src != rank}
        pieces.after()
        results.append((pieces.result(), peers))
    (want, want_peers), (got, got_peers) = results
    for name, a, b in zip(("d_buf", "dw1", "dw3", "dw2"), got, want):
        if name == "d_buf":  # only the own block is written by own(); the peers' come back from the rounds
            a, b = a.view(w, e * c, h)[rank], b.view(w, e * c, h)[rank]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=name)
    for src in want_peers:
        torch.testing.assert_close(got_peers[src], want_peers[src], rtol=1e-5, atol=1e-4)


def _training_step() -> dict:
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.compile_caches import no_compile_caches
    from tests import test_moe_fused_backward as t

    out = {}
    with no_compile_caches():
        torch._dynamo.reset()
        layer = t._layer()
        written = t._compile(layer, "baseline", oc.Report())
        report = oc.Report()
        fn = torch.compile(layer, backend=functools.partial(overlap_backend, report=report))
        with oc.config.patch(force_template="moe_fused", force_config=PACKED):
            t._grads(fn, layer, torch.randn(t.TOKENS, t.H))
            for case in t.ROUTINGS:
                torch.manual_seed(1 + dist.get_rank())
                x = t._route(layer, case, torch.randn(t.TOKENS, t.H))
                got, as_written, eager = (t._grads(f, layer, x) for f in (fn, written, layer))
                out[case] = {"packed vs as written": t._rel(got, as_written), "packed vs eager": t._rel(got, eager),
                             "as written vs eager": t._rel(as_written, eager)}
    out["sites"] = [(r.name.split("_")[0], [(s.rewritten, s.config, s.reason) for s in r.sites]) for r in report.records]
    return out


def test_training_step_with_packed_experts_keeps_every_gradient():
    """fp32, W = 2, random / one-hot / overflowing routing (zero tails of every kind): both
    sections rewritten with the packed config; every gradient within 1e-5 of the layer compiled
    as written, and against eager within the compiled graph's own distance plus that (the bound
    test_moe_fused_backward holds the bmm pieces to: Inductor's kernels put the router's gradient
    ~2e-5 off eager under capacity overflow, in both compiled graphs)."""
    from overlap_compile.testing.multiprocess import run_distributed

    for r in run_distributed(_training_step, world_size=2, timeout_s=300):
        assert [name for name, _ in r["sites"]] == ["forward", "backward"], r["sites"]
        for name, sites in r["sites"]:
            assert len(sites) == 1 and sites[0][0] and sites[0][1] == PACKED, (name, sites)
        for case in ("random", "one hot expert", "capacity overflow"):
            errs = r[case]
            assert max(errs["packed vs as written"]) < 1e-5, (case, errs)
            for packed, written, own in zip(errs["packed vs eager"], errs["as written vs eager"],
                                            errs["packed vs as written"]):
                assert packed <= max(1e-5, written + own * (1 + 1e-6)), (case, errs)  # triangle inequality


def _sites(s_tokens, h, f, e, topk, w=2):
    """A shapes.json moe case's training sections at W ranks (capacity factor 1.25): (forward, backward)."""
    from overlap_compile.templates.moe_fused.model import section_sites

    return section_sites(w, e // w, int(1.25 * s_tokens * topk / e), h, f)


def test_packed_model_weighs_the_padding_against_the_moves():
    """Where the gap is clear in the replays the model is fitted to (the ratios themselves:
    test_packed_overhead_defaults_are_the_fit_of_their_replays), it lands on the same side: on
    MoE-1 and MoE-3 the moves cost more than the skipped padding saves, on the Mixtral shape's
    backward less."""
    from overlap_compile import predictor
    from overlap_compile.predictor.models import Ctx
    from overlap_compile.templates.moe_fused import model as moe_model

    prof, ctx = predictor.load_profile("h100"), Ctx(mode="cuda_graph")
    bmm = {"split": "source", "transport": "p2p"}
    mixtral_backward = _sites(8192, 4096, 14336, 8, 2)[1]
    assert (moe_model.moe_fused(mixtral_backward, PACKED, prof, ctx).total_ms
            < moe_model.moe_fused(mixtral_backward, bmm, prof, ctx).total_ms)
    for site in _sites(8192, 2048, 1536, 8, 2) + _sites(8192, 2048, 1536, 32, 5):  # MoE-1, MoE-3
        assert moe_model.moe_fused(site, PACKED, prof, ctx).total_ms > moe_model.moe_fused(site, bmm, prof, ctx).total_ms


@pytest.mark.parametrize("profile_name", ["h100", "h200"])
def test_gpu_profiles_offer_packed_where_its_launches_replay_for_bf16(profile_name):
    """The packed experts are a GPU candidate only where their launches run from a CUDA graph and
    the section is bf16 (torch._grouped_mm's CUDA dtype; fp32 would read the group ends on the
    host): under Inductor's CUDA graphs either direction; host-launched, the forward whose op
    replays from runtime.op_graphs (the op_graphs option on), not the backward (its op is not
    replayed: spec.backward_host_replay); launched piece by piece never. The bmm copy engine
    always; a CPU profile never offers either."""
    from types import SimpleNamespace

    from torch._inductor import config as inductor_config

    from overlap_compile import config, predictor
    from overlap_compile.templates import get_spec

    spec, prof, cpu = get_spec("moe_fused"), predictor.load_profile(profile_name), predictor.load_profile("cpu-gloo")
    assert spec.host_replay and not spec.backward_host_replay, "the expectations below follow these defaults"
    bmm = {"split": "source", "transport": "p2p"}
    sections = [SimpleNamespace(direction=d, capacity=2560, dtype=dt) for d in ("forward", "backward")
                for dt in (torch.bfloat16, torch.float32)]
    for match in sections:
        bf16 = match.dtype == torch.bfloat16
        with config.patch(op_graphs=False):
            assert spec.candidates(match, prof) == [bmm]
        host = [bmm, PACKED] if bf16 and match.direction == "forward" else [bmm]
        assert spec.candidates(match, prof) == host, (match, spec.candidates(match, prof))
        with inductor_config.patch({"triton.cudagraphs": True}), config.patch(op_graphs=False):
            want = [bmm, PACKED] if bf16 else [bmm]
            assert spec.candidates(match, prof) == want, (match, spec.candidates(match, prof))
            assert all(c.get("transport") != "p2p" for c in spec.candidates(match, cpu))


def test_measured_operands_are_zero_past_the_expected_fill():
    """The predictor's measurements time moe sections on slots zero past the routed share the model
    expects (reference.zero_past_fill): routed rows first, then zeros, in every (source, expert)
    group, along whichever axis holds the slots; weights untouched; bad fills named."""
    from types import SimpleNamespace

    from overlap_compile.templates.moe_fused import backward_op

    t = torch.ones(2 * 3 * 5, 4)
    ref.zero_past_fill(t, 0, 5, 0.6)
    assert t.view(6, 5, 4)[:, :3].eq(1).all() and t.view(6, 5, 4)[:, 3:].eq(0).all()
    u = torch.ones(3, 7, 2 * 4)  # [E, K, W*C]: tokens_t's layout
    ref.zero_past_fill(u, 2, 4, 0.8)  # round(3.2) = 3 slots kept of 4
    assert u.view(3, 7, 2, 4)[..., :3].eq(1).all() and u.view(3, 7, 2, 4)[..., 3:].eq(0).all()
    with pytest.raises(ValueError, match="multiple of the capacity"):
        ref.zero_past_fill(torch.ones(7, 2), 0, 5, 0.5)
    with pytest.raises(ValueError, match="must be in"):
        ref.zero_past_fill(torch.ones(10, 2), 0, 5, 1.5)
    made = []

    def rnd(*shape):
        made.append(torch.ones(shape))
        return made[-1]

    match = SimpleNamespace(world_size=2, e_local=3, capacity=5, hidden=4, ffn=6, group_name="0")
    backward_op.measured_call(match, None, rnd, fill=0.6)
    by_name = dict(zip(backward_op.operand_shapes(backward_op.MoePlan("moe_fused", 2, 3, 5, 4, 6, {"split": "source"},
                                                                       direction="backward")), made))
    for name, dim in backward_op.SLOT_DIMS.items():
        slots = by_name[name].unflatten(dim, (-1, 5))
        assert slots.narrow(dim + 1, 0, 3).eq(1).all() and slots.narrow(dim + 1, 3, 2).eq(0).all(), name
    assert all(by_name[w].eq(1).all() for w in ("w1t", "w3t", "w2t"))


def test_packed_overhead_defaults_are_the_fit_of_their_replays():
    """model.packed_overhead_ms's two defaults are what benchmarks/fitting/fit_packed_overhead.py
    finds in the committed replays they cite (h100 profile): refitting there must give them back."""
    import json
    import os

    from benchmarks.fitting import fit_packed_overhead as fit
    from benchmarks.shape_sets import shapes_by_name
    from overlap_compile import predictor

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shapes = shapes_by_name("moe")
    path = os.path.join(root, "benchmarks", "results",
                        "moe_op_profile-NVIDIA_H100_80GB_HBM3-w2-torch2.11.0-2026-11-27-fused-unpack.json")
    with open(path) as f:
        found = fit.cases(json.load(f), shapes)
    assert sorted((c["shape"], c["direction"]) for c in found) == sorted(
        (s, d) for s in ("MoE-1", "Mixtral-8x7B") for d in ("forward", "backward"))
    factor, piece, fitted = fit.fit(found, predictor.load_profile("h100"))
    assert factor == pytest.approx(2.93, rel=0.02) and piece == pytest.approx(0.0535, rel=0.02)
    assert all(got == pytest.approx(c["ratio"], rel=0.06) for c, got in fitted)
