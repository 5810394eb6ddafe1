"""Putting torch's CUDA generator back after a capture that failed.

``CUDAGraph.capture_begin`` puts the device's default generator in capture mode, and only a
capture that ends cleanly takes it out again (its epilogue runs after ``cudaStreamEndCapture``
succeeds). After a failed capture every random op outside a capture raises "Offset increment
outside graph capture encountered unexpectedly": dropout, sampling, ``torch.randn``. The library
falls back to running a site as written when its capture fails, and that fallback must leave the
user's program as it found it, so ``recover`` ends a capture of nothing cleanly on the same device.
"""
from __future__ import annotations

import warnings

import torch


def recover(device: torch.device, stream: torch.cuda.Stream) -> None:
    """One clean capture of nothing on ``stream`` (not the caller's: it may be the legacy default
    stream, which cannot be captured): the generator's capture mode begins and ends again."""
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(), torch.cuda.device(device), torch.cuda.stream(stream):
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
        graph.capture_begin(capture_error_mode="thread_local")
        graph.capture_end()
    del graph
