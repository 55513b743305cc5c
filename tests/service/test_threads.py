"""torch's host threads of a node (`--threads`): set in the node's process and said in
OMP_NUM_THREADS for the tensor-parallel workers it starts; `pd launch` on the CPU shares the
cores out among its nodes (each node's command line checked in `tests/e2e/test_openai_api.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd.cli.launch import cpu_share
from pd.cli.main import build_parser

PROBE = """
import os, torch
from pd.config import EngineConfig
from pd.service.flags import limit_host_threads
limit_host_threads(EngineConfig(model="unused", device={device!r}), {threads!r})
print(torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
"""


@pytest.mark.parametrize("device, threads, expected", [
    ("cpu", 1, "1 1"),  # given: so many
    ("cpu", None, None),  # on the CPU by default: every core, as torch starts
    ("cuda", None, "1 1"),  # on a GPU by default: one
])
def test_a_process_runs_the_threads_it_is_given(device, threads, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def run(code: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    if expected is None:  # what torch starts with here
        expected = run("import torch; print(torch.get_num_threads())") + " None"
    assert run(PROBE.format(device=device, threads=threads)) == expected


@pytest.mark.parametrize("command", ["decode", "prefill", "launch", "generate"])
def test_fewer_than_one_thread_is_refused(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(command).parse_args([command, "--threads", "0"])
    assert e.value.code == 2
    assert "--threads: '0' is not a number of threads (1 or more)" in capsys.readouterr().err


def test_the_cores_are_shared_out_among_the_nodes():
    cores = len(os.sched_getaffinity(0))
    assert cpu_share(1) == cores
    assert cpu_share(2) == max(1, cores // 2)
    assert cpu_share(10 * cores) == 1  # never none
