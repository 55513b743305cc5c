"""`benchmarks/gpu/bench_kv.py` (the KV ring's bandwidth) on the CPU: a producer process sends
more KV through the ring than it holds, with the pipelined sender, and this process installs it
as the decode node does, holding each record until its copy is done; it must end (a receiver
that never gives the last records back left the producer waiting) with the KV intact, the
requests' blocks in one run or in scattered runs. Its figures come from a GPU host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_kv.py"


@pytest.mark.parametrize("runs", [[], ["--run-blocks", "4"]])
def test_kv_benchmark_protocol_ends_with_the_kv_intact_on_cpu(runs):
    # 6 requests of 8 MiB through a 40 MiB ring: it wraps and fills
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "cpu,cpu", "--tokens", "256", "--requests", "6",
         "--ring-mib", "40", *runs], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "intact True" in out.stdout, out.stdout
