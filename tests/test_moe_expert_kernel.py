"""moe_fused's persistent SwiGLU expert kernel (templates/moe_fused/expert_kernel.py).

On CPU: the tile table's order (every tile once, a phase-2 tile after every phase-1 tile it
reads, the own tokens first), and the kernel itself through Triton's interpreter in a
subprocess (TRITON_INTERPRET=1 set before Triton is imported): odd shapes against the
reference experts, with and without arrival waits, a missing arrival caught by the bounded
wait, counters back at zero. The interpreter runs programs one after another, so these runs
use one program (a phase-2 tile of program 0 waiting on program 1 would wait out its bound).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlap_compile.templates.moe_fused import expert_kernel as EK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("group_m", [1, 2, 8])
@pytest.mark.parametrize("world,rank,e,c,f,h,bm,bf,bh", [
    (2, 0, 2, 37, 24, 40, 16, 16, 16), (3, 1, 1, 20, 48, 32, 16, 32, 16), (4, 3, 3, 5, 16, 16, 16, 16, 16),
    (2, 1, 2, 100, 64, 32, 16, 16, 16)])
def test_tile_order_covers_every_tile_once_and_waits_only_backwards(world, rank, e, c, f, h, bm, bf, bh, group_m):
    order = EK.tile_order(world, rank, e, c, f, h, bm, bf, bh, group_m)
    mb, fb, hb = -(-c // bm), -(-f // bf), -(-h // bh)
    want = {(EK.PHASE_ACT, s, x, m, n) for s in range(world) for x in range(e) for m in range(mb) for n in range(fb)}
    want |= {(EK.PHASE_OUT, s, x, m, n) for s in range(world) for x in range(e) for m in range(mb) for n in range(hb)}
    assert len(order) == len(set(order)) == len(want) and set(order) == want
    position = {t: i for i, t in enumerate(order)}
    for (phase, s, x, m, n), i in position.items():
        if phase == EK.PHASE_OUT:  # every act tile of its rows comes earlier
            assert all(position[(EK.PHASE_ACT, s, x, m, j)] < i for j in range(fb))
    firsts = []
    for phase, s, *_ in order:
        if phase == EK.PHASE_ACT and s not in firsts:
            firsts.append(s)
    assert firsts == [rank] + [(rank - k) % world for k in range(1, world)]  # arrival order
    if world > 1 and (e > 1 or -(-c // bm) > 1):  # own tokens on both sides of the peers': the
        # second half's tiles all after the last peer's outputs (they run while those travel home)
        last_peer = firsts[-1]
        last_out = max(i for i, t in enumerate(order) if t[:2] == (EK.PHASE_OUT, last_peer))
        tail = order[last_out + 1:]
        assert tail and all(t[1] == rank for t in tail) and tail[0][0] == EK.PHASE_ACT, order[-5:]
        assert any(t[:2] == (EK.PHASE_ACT, rank) for t in order[:position[(EK.PHASE_ACT, last_peer, 0, 0, 0)]])
    if group_m > 1 and -(-c // bm) > 1 and -(-f // bf) > 1:  # a group goes column by column
        source = firsts[-1]  # a peer's (or, alone, the own) rows whole: the own may be cut in two
        first = [(m, n) for phase, s, x, m, n in order if (phase, s, x) == (EK.PHASE_ACT, source, 0)]
        assert first[:2] == [(0, 0), (1, 0)], first[:4]


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match="block_f must be a power of two >= 16"):
        EK.ExpertTiles(block_f=48)
    with pytest.raises(ValueError, match="group_m must be an int >= 1, got 0"):
        EK.ExpertTiles(group_m=0)
    with pytest.raises(ValueError, match=r"schedule must be one of \('dynamic', 'static'\), got 'greedy'"):
        EK.ExpertTiles(schedule="greedy")


def test_kernel_under_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", "import tests.test_moe_expert_kernel as t; t.main()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "ALL OK" in proc.stdout, proc.stdout[-4000:]


# ---- what runs in the subprocess ------------------------------------------------------------------

def _weights(e, h, f, dtype):
    import torch

    return (torch.randn(e, h, f, dtype=dtype) / 4, torch.randn(e, h, f, dtype=dtype) / 4,
            torch.randn(e, f, h, dtype=dtype) / 4)


def _interp_operands(e, c, h, f):
    import torch

    return (torch.randn(2, e, c, h), *_weights(e, h, f, torch.float32), torch.empty(2, e, c, f))


def check_against_reference(world, rank, e, c, h, f, cfg, arrived, programs=1):
    import torch

    from overlap_compile.templates.moe_fused import reference

    torch.manual_seed(world * 100 + c)
    x = torch.randn(world, e, c, h)
    ws = _weights(e, h, f, torch.float32)
    counters = EK.Counters.make(world, e, c, cfg.block_m, x.device)
    if not arrived:  # what the copy stream does as each (source, expert) lands
        counters.arrival.view(torch.int32).fill_(1)
    y = EK.swiglu_experts(x, *ws, rank, cfg, programs=programs, counters=counters, arrived=arrived)
    EK.check_errors(counters.err)
    for s in range(world):
        want = reference.experts(x[s], *ws)
        err = ((y[s] - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (world, rank, e, c, h, f, s, err)
    for name in ("arrival", "act_done", "y_done", "ticket"):
        assert int(getattr(counters, name).view(torch.int32).abs().sum()) == 0, name  # back at zero
    print("ok", world, rank, e, c, h, f, cfg.schedule, programs, "arrived" if arrived else "arrival waits")


def _routed(x, block_m):
    """(x with zeros past random routed sizes, the same with the row blocks wholly past them NaN,
    the sizes [W, E]): an empty expert and a full one among them."""
    import torch

    world, e, c, _ = x.shape
    sizes = torch.randint(0, c + 1, (world, e), dtype=torch.int32)
    sizes[0, 0], sizes[-1, -1] = 0, c
    poisoned = x.clone()
    for s in range(world):
        for j in range(e):
            n = int(sizes[s, j])
            x[s, j, n:] = 0
            poisoned[s, j, n:] = 0
            poisoned[s, j, -(-n // block_m) * block_m:] = float("nan")
    return x, poisoned, sizes


def check_sizes(world, rank, e, c, h, f, cfg, arrived):
    """Routed sizes: rows past sizes[s, e] are zero; the row blocks wholly past it are skipped, so
    they are filled with NaN here (a computed one would turn its output rows into NaN) and the
    outputs must still equal the experts of the zero-tailed slots, zeros past the sizes."""
    import torch

    from overlap_compile.templates.moe_fused import reference

    torch.manual_seed(7 + c)
    x, poisoned, sizes = _routed(torch.randn(world, e, c, h), cfg.block_m)
    ws = _weights(e, h, f, torch.float32)
    counters = EK.Counters.make(world, e, c, cfg.block_m, x.device)
    if not arrived:
        counters.arrival.view(torch.int32).fill_(1)
    y = EK.swiglu_experts(poisoned, *ws, rank, cfg, programs=1, counters=counters, arrived=arrived, sizes=sizes)
    EK.check_errors(counters.err)
    assert not bool(y.isnan().any()), "a tile past the routed rows was computed"
    for s in range(world):
        want = reference.experts(x[s], *ws)
        err = ((y[s] - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-5, (world, rank, e, c, h, f, s, err)
        for j in range(e):
            assert bool((y[s, j, int(sizes[s, j]):] == 0).all()), (s, j)
    for name in ("arrival", "act_done", "y_done", "ticket"):
        assert int(getattr(counters, name).view(torch.int32).abs().sum()) == 0, name
    print("ok sizes", world, rank, e, c, h, f, "arrived" if arrived else "arrival waits")


def check_keep(world, rank, e, c, h, f, cfg, sized):
    """Training's intermediates: x and act/gate/up in the saved expert-major layout ([E, W, C, *]
    permuted to the kernel's [W, E, C, *]), through TMA where the shapes allow; every saved
    value equals reference.experts' keep, zeros past the routed rows (``sized``: skipped blocks
    NaN-poisoned in x, so a computed one shows)."""
    import torch

    from overlap_compile.templates.moe_fused import reference

    torch.manual_seed(11 + c)
    x = torch.randn(world, e, c, h)
    poisoned, sizes = x.clone(), None
    if sized:
        x, poisoned, sizes = _routed(x, cfg.block_m)
    ws = _weights(e, h, f, torch.float32)
    tokens = torch.empty(e, world, c, h)
    tokens.permute(1, 0, 2, 3).copy_(poisoned)
    stores = {r: torch.full((e, world, c, f), float("nan")) for r in ("act", "gate", "up")}
    views = {r: t.permute(1, 0, 2, 3) for r, t in stores.items()}
    xin = tokens.permute(1, 0, 2, 3)
    descs = EK._tma_views(xin, *ws, views["act"], cfg, False)
    assert descs[0] is not None and descs[4] is not None, "the expert-major layout takes TMA"
    counters = EK.Counters.make(world, e, c, cfg.block_m, x.device)
    y = EK.swiglu_experts(xin, *ws, rank, cfg, programs=2, counters=counters, sizes=sizes, keep=views)
    EK.check_errors(counters.err)
    for s in range(world):
        kept = {r: torch.empty(e, c, f) for r in ("gate", "up", "act")}
        want = reference.experts(x[s], *ws, keep=kept)
        scale = want.abs().max().clamp_min(1e-12)
        assert ((y[s] - want).abs().max() / scale).item() < 1e-5, (s, "y")
        for r in ("gate", "up", "act"):
            got = views[r][s]
            assert not bool(got.isnan().any()), (s, r, "rows left unwritten or computed from NaN")
            err = ((got - kept[r]).abs().max() / kept[r].abs().max().clamp_min(1e-12)).item()
            assert err < 1e-5, (s, r, err)
    print("ok keep", world, rank, e, c, h, f, "sized" if sized else "full")


def check_missing_arrival():
    import torch

    cfg = EK.ExpertTiles(16, 16, 16, 16)
    world, rank, e, c, h, f = 2, 0, 2, 18, 16, 16
    x = torch.randn(world, e, c, h)
    ws = _weights(e, h, f, torch.float32)
    counters = EK.Counters.make(world, e, c, cfg.block_m, x.device)
    flags = counters.arrival.view(torch.int32)
    flags.fill_(1)
    flags[1 * e + 1] = 0  # source 1's tokens for expert 1 never land
    EK.swiglu_experts(x, *ws, rank, cfg, programs=1, counters=counters, arrived=False, max_polls=50)
    try:
        EK.check_errors(counters.err)
    except RuntimeError as err:
        text = str(err)
        assert "tokens of (source, expert) index 3" in text and "read 0, expected >= 1" in text, text
        assert int(counters.err.abs().sum()) == 0  # the record is cleared once raised
        print("ok missing arrival:", text[:120])
        return
    raise AssertionError("a missing arrival was not reported")


def check_half_precision():
    """fp16 (the interpreter computes bf16 tl.dot wrongly: numpy has no bf16; bf16 runs on GPUs):
    act and y stored in fp16, so a few fp16 ulps from the float32 experts."""
    import torch

    from overlap_compile.templates.moe_fused import reference

    cfg = EK.ExpertTiles(16, 16, 16, 16)
    torch.manual_seed(3)
    x = torch.randn(2, 2, 19, 32).to(torch.float16)
    ws = _weights(2, 32, 48, torch.float16)
    y = EK.swiglu_experts(x, *ws, 1, cfg, programs=1)
    assert y.dtype == torch.float16
    for s in range(2):
        want = reference.experts(x[s].float(), *(w.float() for w in ws))
        err = ((y[s].float() - want).abs().max() / want.abs().max()).item()
        assert err < 5e-3, err
    print("ok fp16", err)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    small = EK.ExpertTiles(16, 16, 16, 16)
    check_against_reference(2, 0, 2, 37, 40, 24, small, arrived=True)
    check_against_reference(2, 1, 2, 37, 40, 24, small, arrived=False)
    check_against_reference(3, 2, 1, 20, 32, 48, EK.ExpertTiles(16, 32, 16, 16), arrived=False)
    check_against_reference(4, 1, 3, 5, 16, 17, small, arrived=True)
    # the interpreter runs programs one after another: under the dynamic schedule the first
    # takes every tile and the others find the ticket past the table; the static schedule with
    # one program takes them in table order too
    check_against_reference(2, 1, 2, 37, 40, 24, small, arrived=False, programs=3)
    check_against_reference(2, 1, 2, 37, 40, 24, EK.ExpertTiles(16, 16, 16, 16, schedule="static"), arrived=False)
    check_against_reference(2, 0, 2, 70, 40, 48, EK.ExpertTiles(16, 16, 16, 16, group_m=3), arrived=False)
    # H, F multiples of block_k: weights (and x, with no arrival waits, and act) through TMA
    # descriptors; C = 37 is no multiple of block_m, so x's and act's descriptors read rows of
    # the next slot
    assert all(d is not None for d in EK._tma_views(*_interp_operands(2, 37, 32, 48), EK.ExpertTiles(16, 32, 16, 16),
                                                     False))
    check_against_reference(2, 0, 2, 37, 32, 48, EK.ExpertTiles(16, 32, 16, 16), arrived=True)
    check_against_reference(2, 0, 2, 37, 32, 48, EK.ExpertTiles(16, 32, 16, 16, tma=False), arrived=True)
    check_sizes(2, 0, 3, 37, 40, 24, small, arrived=True)
    check_sizes(3, 1, 2, 50, 32, 48, EK.ExpertTiles(16, 32, 16, 16), arrived=False)
    check_keep(2, 1, 2, 37, 32, 48, EK.ExpertTiles(16, 32, 16, 16), sized=False)
    check_keep(2, 0, 3, 37, 32, 48, EK.ExpertTiles(16, 32, 16, 16), sized=True)
    check_missing_arrival()
    check_half_precision()
    print("ALL OK")
