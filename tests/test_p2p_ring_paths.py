"""p2p_ring's GPU paths, the parts that run on CPU: symmetric-buffer cache keys and reasons,
config validation for the copy-engine transport, dispatch, candidates under GPU / CPU profiles,
the bounded wait (through Triton's interpreter) and the error message it leads to."""
from __future__ import annotations

import os

import pytest
import dataclasses

import torch

from overlap_compile.passes.matches import GemmAllToAllMatch
from overlap_compile.runtime import spin_wait, symm
from overlap_compile.templates.p2p_ring import kernels, mailbox, op, reference
from overlap_compile.templates.p2p_ring.spec import SPEC
from overlap_compile.templates.plans import GemmCollectivePlan
from tests.test_p2p_ring import _ag_match, _rs_match

P2P = {"slices": 1, "bidirectional": False, "transport": "p2p"}


# ---- runtime.symm ------------------------------------------------------------------------------

def test_cache_key_separates_what_must_not_share_a_buffer():
    dev = torch.device("cuda", 1)
    k = symm.cache_key("0", "p2p_ring/rs", (4, 5), torch.bfloat16, dev)
    assert k == symm.cache_key("0", "p2p_ring/rs", [4, 5], torch.bfloat16, dev)
    others = [symm.cache_key("1", "p2p_ring/rs", (4, 5), torch.bfloat16, dev),
              symm.cache_key("0", "p2p_ring/ag", (4, 5), torch.bfloat16, dev),
              symm.cache_key("0", "p2p_ring/rs", (5, 4), torch.bfloat16, dev),
              symm.cache_key("0", "p2p_ring/rs", (4, 5), torch.float16, dev),
              symm.cache_key("0", "p2p_ring/rs", (4, 5), torch.bfloat16, torch.device("cuda", 0))]
    assert len({k, *others}) == 6
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        symm.cache_key("0", "", (1,), torch.float32, dev)
    with pytest.raises(ValueError, match="negative size"):
        symm.cache_key("0", "x", (2, -1), torch.float32, dev)


def test_buffers_first_made_inside_dropped_after_are_forgotten_at_its_end():
    kept = ("g", "test/kept", (4,), torch.float32, "cpu", 0)
    made = ("g", "test/made", (4,), torch.float32, "cpu", 0)
    symm._cache[kept] = "kept buffer"
    try:
        with symm.dropped_after(None):
            symm._cache[made] = "made inside"
            assert made in symm._cache
        assert made not in symm._cache and symm._cache[kept] == "kept buffer"
        with pytest.raises(RuntimeError, match="timing failed"):  # forgotten on the way out of an error too
            with symm.dropped_after(None):
                symm._cache[made] = "made inside"
                raise RuntimeError("timing failed")
        assert made not in symm._cache
    finally:
        symm._cache.pop(kept, None)
        symm._cache.pop(made, None)


def test_node_reasons():
    assert symm.node_reason(2, 2, []) is None
    assert symm.node_reason(4, 8, []) is None
    assert "not all on this node" in symm.node_reason(8, 4, [])
    assert "no peer access between GPUs 0 and 1" in symm.node_reason(2, 2, [(0, 1)])
    assert "no peers" in symm.node_reason(1, 1, [])


def test_usable_says_why_on_cpu():
    assert "needs CUDA tensors" in symm.usable("0", torch.device("cpu"))
    assert not symm.available("0", torch.device("cpu"))


def test_write_value32_checks_its_arguments():
    with pytest.raises(ValueError, match="1-D uint32"):
        symm.write_value32(torch.zeros(4, dtype=torch.int32), 0, 1)
    with pytest.raises(ValueError, match="index 4 outside"):
        symm.write_value32(torch.zeros(4, dtype=torch.uint32), 4, 1)


# ---- configs, dispatch, candidates ---------------------------------------------------------------

def test_p2p_transport_configs():
    for kind in reference.KINDS:
        assert reference.config_problem(kind, P2P) is None
        assert reference.config_problem(kind, {**P2P, "slices": 3}) is None
    assert "bidirectional=False" in reference.config_problem("gemm_reducescatter", {**P2P, "bidirectional": True})
    assert "transport" in reference.config_problem("allgather_gemm", {**P2P, "transport": "nvshmem"})


def _plan(**kw):
    base = dict(template="p2p_ring", kind="gemm_reducescatter", m=8, n=3, k=5, world=2, reduce_op="sum", outer=1,
                chunk=4, has_bias=False, config=P2P)
    return GemmCollectivePlan(**{**base, **kw})


def test_dispatch_on_cpu_is_the_reference():
    assert "transport is not 'p2p'" in kernels.usable("0", torch.device("cpu"), _plan(config={**P2P, "transport": "nccl"}))
    assert "whole row stripes" in kernels.usable("0", torch.device("cpu"), _plan(outer=2, chunk=2))
    assert "needs CUDA tensors" in kernels.usable("0", torch.device("cpu"), _plan())
    assert op.path("0", torch.device("cpu"), _plan()) == "reference"
    from overlap_compile.templates.p2p_ring import kernels_nccl

    assert "slices=1" in kernels_nccl.usable("0", torch.device("cpu"), _plan(config={**P2P, "transport": "nccl",
                                                                                    "slices": 2}))


class _Profile:
    def __init__(self, gpu):
        self.gpu = gpu


def test_candidates_under_gpu_profile_have_gpu_paths():
    """Under a GPU profile only the copy engine (NCCL send/recv measured slower than sequential);
    a site whose stripes are not whole rows (outer > 1) has no copy-engine path: no candidate."""
    rs, ag = _rs_match(world=4, m=16), _ag_match(world=4, m=16)
    a2a = _rs_match(world=4, m=16, cls=GemmAllToAllMatch, reduce_op=None)
    for match in (rs, ag, a2a):
        gpu = SPEC.candidates(match, _Profile("NVIDIA H200"))
        assert gpu == [P2P], gpu
        cpu = SPEC.candidates(match, _Profile("CPU (gloo)"))
        assert len(cpu) > len(gpu)
    rs.stripes = dataclasses.replace(rs.stripes, outer=2)
    assert SPEC.candidates(rs, _Profile("NVIDIA H200")) == []


# ---- the bounded wait (interpreter) and its message ---------------------------------------------

@pytest.fixture(scope="module")
def interp_wait():
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        k = spin_wait.jit_wait_kernel()
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    if type(k).__name__ != "InterpretedFunction":
        pytest.skip("this Triton does not honour TRITON_INTERPRET at decoration time")
    return k


def _wait(k, flags, index, target, until_equal, tag=7):
    err = torch.zeros(5, dtype=torch.int32)
    k[(1,)](flags, index, target, err, 10_000_000, 5, tag, USE_TIMER=False, UNTIL_EQUAL=until_equal, SYS=True,
            num_warps=1)
    return err.tolist()


def test_wait_until_equal(interp_wait):
    flags = torch.tensor([0, 1, 0, 0], dtype=torch.int32)
    assert _wait(interp_wait, flags, 1, 1, True) == [0, 0, 0, 0, 0]  # READY seen, consumed
    assert flags.tolist() == [0, 0, 0, 0]
    assert _wait(interp_wait, flags, 3, 0, True) == [0, 0, 0, 0, 0]  # BUSY already free
    flags[2] = 1
    assert _wait(interp_wait, flags, 2, 0, True, tag=9) == [1, 9, 1, 0, 1]  # never released: bounded, recorded
    flags[0] = 3
    assert _wait(interp_wait, flags, 0, 1, False, tag=4) == [1, 4, 3, 1, 1]  # GEQ mode: overshoot recorded


def test_failure_message_names_template_step_and_value():
    dev = torch.device("cpu")
    tag = kernels._tag("gemm_reducescatter, ring step 2: wait for rank 3's data (READY flag 3)")
    rec = spin_wait.record_buffer(dev)
    rec.copy_(torch.tensor([1, tag, 0, 1, 1], dtype=torch.int32))
    assert spin_wait.failure(dev) == (tag, 0, 1)
    with pytest.raises(kernels.SignalTimeoutError, match=r"p2p_ring: gemm_reducescatter, ring step 2.*read 0, expected 1"):
        kernels.check_errors(dev, synchronize=False)
    assert spin_wait.failure(dev) is None  # raised once, then cleared


def test_ring_order_helpers_match_the_schedule():
    w = 4
    for r in range(w):
        assert [reference.rs_stripe(r, w, s) for s in range(w)][-1] == r
        assert sorted(reference.rs_stripe(r, w, s) for s in range(w)) == list(range(w))
        assert reference.ag_source(r, w, 0) == r
        assert sorted(reference.ag_source(r, w, s) for s in range(w)) == list(range(w))
        pairs = [reference.a2a_pair(r, w, s) for s in range(1, w)]
        assert sorted(d for d, _ in pairs) == sorted(s for _, s in pairs) == [q for q in range(w) if q != r]
        for s in range(w - 1):  # the partial rank r + s + 1 computes at step s is for rank r
            assert reference.rs_stripe((r + s + 1) % w, w, s) == r


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_each_receive_buffer_has_one_slot_per_peer(world):
    """A rank's buffers hold W-1 slots: every peer its own, none for the rank itself (at W=2 a
    slot per rank would double the symmetric memory for nothing)."""
    for owner in range(world):
        slots = [mailbox.slot_of(owner, sender, world) for sender in range(world) if sender != owner]
        assert sorted(slots) == list(range(world - 1)), (owner, slots)
    with pytest.raises(ValueError, match="no slot for rank 1 in rank 1's buffer"):
        mailbox.slot_of(1, 1, world)
    with pytest.raises(ValueError, match="world size"):
        mailbox.slot_of(0, world, world)


# ---- the group's mailbox (mailbox.py) ------------------------------------------------------------

class _FakeSymm:
    """runtime.symm.symm_buffer over plain CPU tensors, counting allocations by key."""

    def __init__(self, rank=0, world=2):
        self.made: dict[tuple, object] = {}
        self.rank, self.world = rank, world

    def __call__(self, group_name, key, shape, dtype, device, zero=False):
        k = (group_name, key, tuple(shape), dtype)
        if k not in self.made:
            ts = [torch.zeros(shape, dtype=dtype) for _ in range(self.world)]
            self.made[k] = dataclasses.make_dataclass("Buf", ["local", "rank", "world", "ts"])(
                ts[self.rank], self.rank, self.world, ts)
            self.made[k].peer = lambda q, ts=ts: ts[q]
        return self.made[k]


@pytest.fixture
def fake_symm(monkeypatch):
    fake = _FakeSymm()
    monkeypatch.setattr(symm, "symm_buffer", fake)
    monkeypatch.setattr(symm, "_grown", {})
    return fake


def _data_keys(fake):
    return sorted(k[1] for k in fake.made if not k[1].endswith("/flags"))


def test_gathers_scatters_and_all_to_alls_of_any_rows_share_one_mailbox_and_its_flags(fake_symm):
    dev = torch.device("cpu")
    ag_a, flags_a = kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.bfloat16, dev)
    ag_b, flags_b = kernels._gather_flags("g", _plan_ag(rows=3, k=8), torch.bfloat16, dev)  # another bucket
    rs, flags_rs = kernels._push_flags("g", _plan_rs("gemm_reducescatter", rows=6, n=8), None, "rs", torch.bfloat16, dev)
    a2a, flags_a2a = kernels._push_flags("g", _plan_rs("gemm_alltoall", rows=4, n=8), None, "a2a", torch.bfloat16, dev)
    assert ag_a.buf is ag_b.buf is rs.buf is a2a.buf
    assert flags_a.buf is flags_b.buf is flags_rs.buf is flags_a2a.buf
    assert tuple(ag_a.local.shape) == (1, 6, 8) and tuple(a2a.local.shape) == (1, 4, 8)  # W-1 = 1 slot
    ag_b.local[0].fill_(3.0)  # the same memory: the smaller call's face is the start of the slot
    assert ag_a.local[0].flatten()[:24].eq(3.0).all() and ag_a.local[0].flatten()[24:].eq(0.0).all()
    assert rs.local[0].flatten()[:24].eq(3.0).all()
    ag_a.peer(1)[0, 5, 7] = 9.0  # rank 1's copy, as rank 0 writes into it
    assert fake_symm.made[("g", "p2p_ring/mailbox/grown48", (1, 48), torch.bfloat16)].ts[1][0, 47] == 9.0
    # another dtype or group gets its own
    kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.float32, dev)
    kernels._gather_flags("h", _plan_ag(rows=6, k=8), torch.bfloat16, dev)
    assert sorted((k[0], str(k[3])) for k in fake_symm.made if not k[1].endswith("/flags")) == [
        ("g", "torch.bfloat16"), ("g", "torch.float32"), ("h", "torch.bfloat16")]


def test_the_mailbox_grows_to_the_largest_call_and_keeps_the_smaller(fake_symm):
    from overlap_compile.templates.p2p_ring import mailbox

    dev = torch.device("cpu")
    small, flags_small = kernels._gather_flags("g", _plan_ag(rows=3, k=5), torch.bfloat16, dev)
    big, flags_big = kernels._gather_flags("g", _plan_ag(rows=7, k=9), torch.bfloat16, dev)
    assert big.buf.local.shape[-1] == 63 and small.buf.local.shape[-1] == 15
    assert big.buf is not small.buf and flags_big.buf is not flags_small.buf  # fresh flags with fresh memory
    again, _ = kernels._gather_flags("g", _plan_ag(rows=3, k=5), torch.bfloat16, dev)
    assert again.buf is big.buf  # later small calls use the grown one
    assert _data_keys(fake_symm) == ["p2p_ring/mailbox/grown15",
                                     "p2p_ring/mailbox/grown63"]
    with pytest.raises(ValueError, match="world size >= 2"):
        mailbox.mailbox("g", 1, 3, 5, torch.bfloat16, dev)
    with pytest.raises(ValueError, match="negative size"):
        symm.grown_buffer("g", "p2p_ring/x", (1,), -4, torch.bfloat16, dev)


def test_the_all_reduce_keeps_buffers_of_its_own(fake_symm):
    dev = torch.device("cpu")
    kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.bfloat16, dev)
    kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.bfloat16, dev, kernels.ALLREDUCE)
    kernels._push_flags("g", _plan_rs("gemm_reducescatter", rows=6, n=8), kernels.ALLREDUCE, "rs", torch.bfloat16, dev)
    kernels._push_flags("g", _plan_rs("gemm_reducescatter", rows=6, n=8), kernels.ALLREDUCE + "/c1", "rs",
                        torch.bfloat16, dev)
    assert _data_keys(fake_symm) == ["p2p_ring/allgather/allreduce/grown48", "p2p_ring/mailbox/grown48",
                                     "p2p_ring/reducescatter/allreduce/c1/grown48",
                                     "p2p_ring/reducescatter/allreduce/grown48"]


def _plan_ag(rows, k, w=2):
    from overlap_compile.templates.plans import AllGatherGemmPlan

    return AllGatherGemmPlan(template="p2p_ring", m=w * rows, k=k, ns=(4,), world=w, outer=1, chunk=rows,
                             has_bias=(False,), config=dict(P2P), timeout_ms=100)


def _plan_rs(kind, rows, n, w=2):
    return GemmCollectivePlan(template="p2p_ring", kind=kind, m=w * rows, n=n, k=4, world=w,
                              reduce_op="sum" if kind == "gemm_reducescatter" else None, outer=1, chunk=rows,
                              has_bias=False, config=dict(P2P), timeout_ms=100)


def test_a_calls_views_are_made_once_and_go_with_their_buffer(monkeypatch):
    """The mailbox face, its slots and the flag view are kept in the buffer's memo (a host-launched
    call asks for them every time) and hold no reference back to it: dropping the buffer frees it
    at once, without the garbage collector."""
    import gc
    import weakref

    dev = torch.device("cpu")
    monkeypatch.setattr(symm, "_grown", {})
    peers = {}

    class Handle:  # what rendezvous returns: the peers' buffers mapped here
        def get_buffer(self, rank, shape, dtype, offset):
            return peers.setdefault((shape, dtype), torch.zeros(shape, dtype=dtype))

    def put(key, shape, dtype):
        buf = symm.SymmBuffer(torch.zeros(shape, dtype=dtype), Handle(), 0, 2, 0, None, None)
        symm._cache[symm.cache_key("g", key, shape, dtype, dev)] = buf
        return buf

    data = put("p2p_ring/mailbox/grown48", (1, 48), torch.bfloat16)
    put("p2p_ring/mailbox/2x48/torch.bfloat16/flags", (4,), torch.uint32)
    try:
        box, flags = kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.bfloat16, dev)
        box2, flags2 = kernels._gather_flags("g", _plan_ag(rows=6, k=8), torch.bfloat16, dev)
        assert box is box2 and flags is flags2 and box.buf is data
        assert kernels._mine(box, 1) is kernels._mine(box, 1) and kernels._theirs(box, 1) is kernels._theirs(box, 1)
        assert kernels._mine(box, 1).data_ptr() == data.local.data_ptr()  # rank 1's slot of my buffer
        smaller, _ = kernels._gather_flags("g", _plan_ag(rows=3, k=8), torch.bfloat16, dev)
        assert smaller is not box and smaller.buf is data and tuple(smaller.local.shape) == (1, 3, 8)
        gone = weakref.ref(data)
        del data, box2, flags2
        gc.disable()
        try:
            for k in [k for k in symm._cache if k[0] == "g"]:
                del symm._cache[k]
            assert gone() is None and box.buf is None and flags.buf is None
        finally:
            gc.enable()
    finally:
        for k in [k for k in symm._cache if k[0] == "g"]:
            del symm._cache[k]
