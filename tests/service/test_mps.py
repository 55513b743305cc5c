"""`pd launch --mps`: the private MPS daemon (`pd.service.mps`) with a stand-in for
nvidia-cuda-mps-control (no GPU here; the daemon itself runs in `bench_serving.py --launch-args
--mps` on a GPU host), and the launch's refusal on CPU."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pd.cli.main import main
from pd.service.mps import CONTROL, MPSDaemon, MPSError

FAKE = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "stdin": "" if sys.argv[1:] else sys.stdin.read(),
                        "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}) + "\\n")
sys.exit({code})
"""


def fake_control(tmp_path, monkeypatch, code: int = 0):
    import sys

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    exe = bin_dir / CONTROL
    exe.write_text(FAKE.format(python=sys.executable, log=str(log), code=code))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_the_daemon_has_its_own_pipe_directory_and_quits(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    mps = MPSDaemon()
    env = mps.start()
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.path.isdir(pipe) and stat.S_IMODE(os.stat(mps.dir).st_mode) == 0o700
    mps.stop()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["argv"] for c in calls] == [["-d"], []] and calls[1]["stdin"] == "quit\n"
    assert all(c["pipe"] == pipe and c["log"] == env["CUDA_MPS_LOG_DIRECTORY"] for c in calls)
    assert not os.path.exists(mps.dir)


def test_a_daemon_that_does_not_start_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch, code=3)
    mps = MPSDaemon()
    with pytest.raises(MPSError, match="failed"):
        mps.start()
    assert not os.path.exists(mps.dir)


def test_without_the_driver_tools_mps_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MPSError, match=CONTROL):
        MPSDaemon()


def test_launch_refuses_mps_on_cpu_before_starting_anything(tiny_model_dir, capsys):
    assert main(["launch", "--model", str(tiny_model_dir), "--device", "cpu", "--mps"]) == 1
    err = capsys.readouterr().err
    assert "--mps needs --device cuda" in err and "node" not in err


@pytest.mark.parametrize("extra", [["--prefill-sm-percent", "50"],
                                   ["--mps", "--prefill-sm-percent", "0"],
                                   ["--mps", "--prefill-sm-percent", "101"]])
def test_launch_refuses_a_prefill_share_without_mps_or_out_of_range(tiny_model_dir, capsys, extra):
    # NOTE: --device cuda passes the CPU check of --mps; the share is refused before any node
    assert main(["launch", "--model", str(tiny_model_dir), "--device", "cuda", *extra]) == 1
    err = capsys.readouterr().err
    assert "--prefill-sm-percent" in err and "node" not in err


def test_the_prefill_share_and_priority_change_only_the_environment_they_are_given_to():
    from pd.cli.launch import prefill_mps_env

    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}
    assert prefill_mps_env(mps_env, None) is mps_env and prefill_mps_env(None, 50, True) is None
    assert prefill_mps_env(mps_env, 40) == {**mps_env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    assert prefill_mps_env(mps_env, None, True) == {**mps_env, "CUDA_MPS_CLIENT_PRIORITY": "1"}
    assert prefill_mps_env(mps_env, 50, True) == {**mps_env, "CUDA_MPS_CLIENT_PRIORITY": "1",
                                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert mps_env == {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}


def test_launch_refuses_a_prefill_priority_without_mps(tiny_model_dir, capsys):
    assert main(["launch", "--model", str(tiny_model_dir), "--device", "cuda",
                 "--prefill-low-priority"]) == 1
    err = capsys.readouterr().err
    assert "--prefill-low-priority" in err and "--mps" in err and "node" not in err
