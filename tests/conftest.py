import pytest
import torch

from overlap_compile.testing.multiprocess import keep_ranks_between_runs


def pytest_configure(config):
    """Multi-rank CPU tests run on gloo ranks kept between tests (testing/multiprocess.py): a
    rank's start-up (Python, torch, the process group) costs seconds, paid once per world size."""
    keep_ranks_between_runs()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip (with the reason shown) on machines without enough CUDA devices."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
