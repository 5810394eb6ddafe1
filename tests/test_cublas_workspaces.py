"""runtime.cublas_workspaces on a CPU: ``released()`` clears torch's cuBLAS workspaces on entry
and exit (a stand-in for torch's clear), nothing without CUDA, and the compile-time timing thread
(predictor.exhaustive.on_fresh_thread) releases its workspaces when its work is done, also when
the work fails."""
import pytest
import torch

from overlap_compile.predictor import exhaustive
from overlap_compile.runtime import cublas_workspaces


@pytest.fixture
def clears(monkeypatch):
    got: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: got.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return got


def test_released_clears_on_entry_and_exit(clears):
    with cublas_workspaces.released():
        clears.append("inside")
    assert clears == ["clear", "inside", "clear"]


def test_nothing_to_release_without_cuda(monkeypatch):
    got = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: got.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cublas_workspaces.release()
    assert got == []


def test_the_timing_thread_releases_its_workspaces_after_its_work(monkeypatch):
    got = []
    monkeypatch.setattr(cublas_workspaces, "release", lambda: got.append("release"))
    assert exhaustive.on_fresh_thread(lambda: got.append("work") or 7) == 7
    with pytest.raises(ValueError, match="boom"):
        exhaustive.on_fresh_thread(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert got == ["work", "release", "release"]
