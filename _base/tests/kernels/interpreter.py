"""A script of kernel checks run by triton's interpreter (CPU tensors) in a child process: how the
Triton kernels' logic is tested on machines without a GPU (CI). The script prints "ok"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
