"""runtime.op_graphs' bookkeeping on a CPU (captures stood in for by a fake graph): a site whose
buffers settle is captured once and replayed; a site whose buffers move every step (a training
step's activations) is declined after a few graphs go unreplayed, its graphs dropped; a model
whose layers share one site (each layer's graph replayed a step later) is never declined; a declined
site still captures a call whose buffers keep coming back."""
from __future__ import annotations

import pytest
import torch

from overlap_compile.runtime import op_graphs

DEV = torch.device("cuda", 0)  # only its index is read: nothing here touches a GPU


class FakeGraph:
    def __init__(self, call):
        self.call, self.replays, self.reset_called = call, 0, False

    def replay(self):
        self.replays += 1

    def reset(self):
        self.reset_called = True


@pytest.fixture
def graphs(monkeypatch):
    made: list[FakeGraph] = []

    def capture(static_key, device, call):
        made.append(FakeGraph(call))
        return made[-1]

    monkeypatch.setattr(op_graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    op_graphs.clear()
    yield made
    op_graphs.clear()


class Buf:
    """A stand-in tensor: an address, a shape, strides and a dtype are all a key reads."""

    def __init__(self, addr: int):
        self.addr = addr

    def data_ptr(self):
        return self.addr

    shape, dtype = (4, 4), torch.float32

    def stride(self):
        return (4, 1)


def _call(site: tuple, addr: int, ran: list) -> None:
    op_graphs.run(site, DEV, (Buf(addr),), (Buf(addr + 1),), lambda: ran.append(addr))


def test_settled_buffers_are_captured_once_and_replayed(graphs):
    ran: list[int] = []
    for _ in range(50):
        _call(("site",), 1000, ran)
    assert (op_graphs.stats["eager"], op_graphs.stats["captured"], op_graphs.stats["replayed"]) == (1, 1, 48)
    assert len(graphs) == 1 and graphs[0].replays == 49 and not op_graphs.declined()


def test_buffers_moving_every_step_get_the_site_declined_and_its_graphs_dropped(graphs):
    # each step's buffers come back once (a warm-up pair), never after: captured, never replayed
    ran: list[int] = []
    for step in range(40):
        for _ in range(2):
            _call(("site",), 1000 * (step + 1), ran)
    declined = op_graphs.declined()
    assert list(declined) == [("site",)] and "not replayed" in declined[("site",)]
    captured = op_graphs.stats["captured"]
    # a capture every other call: the graph count grows half as fast as the calls, so a graph goes
    # stale within about twice STALE_AFTER + STALE_GRAPHS calls
    assert 0 < captured <= 2 * (op_graphs.STALE_GRAPHS + op_graphs.STALE_AFTER)
    assert all(g.reset_called for g in graphs)  # their pool memory can go back
    assert op_graphs.stats["declined"] > 0 and len(ran) == 80 - captured  # every other call ran as written
    # declined, the site still captures a call whose buffers come back SETTLED_SIGHTINGS times (an
    # inference graph after training with the same plan): captured on that sighting, replayed after
    before = op_graphs.stats.copy()  # a Counter: a missing count reads 0
    for _ in range(op_graphs.SETTLED_SIGHTINGS + 5):
        _call(("site",), 99_000, ran)
    assert op_graphs.stats["captured"] == before["captured"] + 1
    assert op_graphs.stats["replayed"] == before["replayed"] + 5
    assert op_graphs.stats["declined"] == before["declined"] + op_graphs.SETTLED_SIGHTINGS - 1
    assert ("site",) in op_graphs.declined()


def test_layers_sharing_a_site_replay_a_step_later_and_are_not_declined(graphs):
    ran: list[int] = []
    layers = 32
    for _ in range(6):
        for layer in range(layers):
            _call(("site",), 1000 * (layer + 1), ran)
    assert not op_graphs.declined()
    assert op_graphs.stats["captured"] == layers and op_graphs.stats["replayed"] == 4 * layers


def test_one_site_declined_leaves_another_captured(graphs):
    ran: list[int] = []
    for step in range(40):
        _call(("moving",), 1000 * (step + 1), ran)
        _call(("moving",), 1000 * (step + 1), ran)
        _call(("settled",), 5, ran)
    assert list(op_graphs.declined()) == [("moving",)]
    assert op_graphs.stats["replayed"] >= 38


def test_a_failed_capture_puts_the_generator_back(monkeypatch):
    """A capture that fails leaves torch's CUDA generator in capture mode (every random op after
    it raises "Offset increment outside graph capture"); the fallback to the op as written first
    ends a clean capture of nothing (runtime/failed_capture.recover) on the side stream."""
    import contextlib

    from overlap_compile.runtime import cublas_workspaces, failed_capture

    class Stream:
        def wait_stream(self, other):
            pass

    class Broken:
        def capture_begin(self, **kw):
            pass

        def capture_end(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    side = Stream()
    recovered = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Broken)
    monkeypatch.setattr(op_graphs, "_side_stream", lambda device: side)
    monkeypatch.setattr(op_graphs, "_pool", lambda device: (0, 1))
    monkeypatch.setattr(cublas_workspaces, "released", contextlib.nullcontext)
    monkeypatch.setattr(failed_capture, "recover", lambda device, stream: recovered.append((device, stream)))
    op_graphs.clear()
    with pytest.warns(UserWarning, match="could not be captured"):
        assert op_graphs._capture(("site",), DEV, lambda: None) is None
    assert recovered == [(DEV, side)]
    assert ("site",) in op_graphs.failures()
    op_graphs.clear()


def test_graphs_captured_inside_apart_go_at_its_end(graphs):
    """settle's timing drops the symmetric buffers it made (runtime.symm.dropped_after); the op
    graphs it captured address them, so they go too. A later call at the same addresses (the
    site timed again, its operands where they were) runs afresh instead of replaying one."""
    ran: list[int] = []
    for _ in range(3):
        _call(("model site",), 500, ran)  # captured before: kept
    with op_graphs.apart(None):
        for _ in range(3):
            _call(("timed site",), 1000, ran)
        assert len(graphs) == 2 and graphs[1].replays == 2
    assert graphs[1].reset_called and not graphs[0].reset_called
    eager = op_graphs.stats["eager"]
    _call(("timed site",), 1000, ran)  # the same key again: not a replay of the dropped graph
    assert graphs[1].replays == 2 and op_graphs.stats["eager"] == eager + 1
    _call(("model site",), 500, ran)
    assert graphs[0].replays == 3


def test_a_site_the_model_declined_is_timed_as_a_settled_one_inside_apart(graphs):
    """A training step's buffers move, so its sites get declined; an inference graph compiled
    afterwards times the same site (same plan, same static key). Inside apart() the timing's calls
    are captured on their second sighting and replayed, as in a fresh process, and leave the
    model's records as they were."""
    site = ("shared site",)
    ran: list[int] = []
    for step in range(40):
        for _ in range(2):  # a warm-up pair, then new addresses every step
            _call(site, 1000 * (step + 1), ran)
    assert site in op_graphs.declined()
    calls_before = op_graphs._calls[site]
    with op_graphs.apart(None):
        made = len(graphs)
        timed: list[int] = []
        for _ in range(5):
            _call(site, 7, timed)
        assert len(graphs) == made + 1 and graphs[-1].replays == 4  # captured at sight 2, then replayed
        assert timed == [7]  # only the first sighting ran as written
    assert site in op_graphs.declined() and op_graphs._calls[site] == calls_before
    assert not [k for k in op_graphs._seen if not isinstance(k[0][0], str)]  # the block's records went
    after: list[int] = []
    for _ in range(3):
        _call(site, 7, after)  # outside again: the model's site is still declined
    assert after == [7, 7, 7]


def test_timed_calls_of_an_op_are_replays_even_when_its_output_moves_between_rounds(graphs, monkeypatch):
    """settle's host-launched timing interleaves the site as written and the template op, round by
    round. With many free blocks in the caching allocator (a model has run) the op's output can
    land at a new address each round: those calls run as written, then are captured. Every round
    first calls each item untimed until its graph replays, so the timed samples are replays."""
    from overlap_compile.predictor import exhaustive

    state = {"last": None, "out": 100}

    def as_written():
        state["last"] = "as written"

    def template_op():
        if state["last"] != "op":  # the other item ran in between: the op's output lands elsewhere
            state["out"] += 64
        state["last"] = "op"
        op_graphs.run(("timed op",), DEV, (Buf(7),), (Buf(state["out"]),), lambda: None)

    timed: list[bool] = []

    def sample(run, device, queued):
        before = (op_graphs.stats["replayed"], op_graphs.stats["captured"])
        run()
        if run is template_op:
            timed.append((op_graphs.stats["replayed"], op_graphs.stats["captured"]) == (before[0] + 1, before[1]))
        return 1.0

    monkeypatch.setattr(exhaustive, "_sample", sample)
    exhaustive._time_all([as_written, template_op, as_written], "cpu")
    assert len(timed) == exhaustive.ROUNDS * exhaustive.PER_ROUND
    assert all(timed), f"timed calls that were not replays: {timed}"
