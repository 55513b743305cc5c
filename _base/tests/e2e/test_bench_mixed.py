"""`benchmarks/gpu/bench_mixed.py` (the two-GPU mixed-load run) on the CPU with a tiny model:
both setups run the streams alone and with arriving prompts, and print their ITL rows. Only that
the script works is checked here; its figures come from a GPU host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_mixed.py"


def test_mixed_load_benchmark_runs_both_setups_on_cpu():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--prefill-device", "cpu", "--decode-device", "cpu",
         "--streams", "2", "--stream-prompt", "16", "--stream-tokens", "48", "--prompt-len", "256",
         "--long-tokens", "4", "--interval", "0.1", "--warmup", "0", "--max-long", "3"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line.split("|") for line in out.stdout.splitlines()
            if line.strip().startswith(("PD shm |", "colocated |"))}
    assert set(rows) == {"PD shm", "colocated"}, out.stdout
    for cells in rows.values():
        alone, mixed = map(float, cells[1].split()), map(float, cells[2].split())
        assert all(v > 0 for v in [*alone, *mixed]), cells
        # NOTE: --warmup 0 makes the first prompt due at the start, while the streams decode,
        # whatever this machine's speed (0.05 s let a fast host finish the streams first)
        assert int(cells[3]) > 0, cells  # prompts did arrive while the streams decoded
    joined = [line for line in out.stdout.splitlines() if line.startswith("PD shm: an arriving")]
    assert len(joined) == 1 and float(joined[0].split("p50 ")[1].split(",")[0]) > 0, out.stdout
