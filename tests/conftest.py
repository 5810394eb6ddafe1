import os

# Inductor's CPU kernels compile without the vector ISA in the CPU suite: the tests check the
# passes, templates and harness, not Inductor's vector code, and scalar kernels compile in about
# two thirds of the time (the suite compiles hundreds of them, cold on a fresh CI machine). Set
# before torch is imported (Inductor's config reads it then); the ranks the tests spawn inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

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
