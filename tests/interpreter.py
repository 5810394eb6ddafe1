"""Run test code under Triton's interpreter in a subprocess, so TRITON_INTERPRET=1 (read when
Triton is imported) leaks into no other test: the kernels then run on CPU tensors."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(code: str, timeout_s: int = 300) -> None:
    """Run ``code`` (from the repository root, Triton interpreting); it must print ``ALL OK``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
