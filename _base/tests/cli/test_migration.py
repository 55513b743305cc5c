"""Coming from vLLM: a hub id instead of a directory gets one line, vLLM's flag spellings and
`pd serve MODEL` parse as pd's own, and `pd launch` refuses a busy port before it starts a node.
(`tests/e2e/test_openai_api.py` runs `pd serve DIR` for real.)"""

from __future__ import annotations

import socket

import pytest

from pd.cli.main import build_parser, main
from pd.service.flags import engine_config


@pytest.mark.parametrize("command", ["generate", "launch", "serve", "prefill"])
def test_a_hub_id_gets_one_line(command, capsys):
    argv = [command, "meta-llama/Llama-3.2-1B"] if command == "serve" else [
        command, "--model", "meta-llama/Llama-3.2-1B"]
    if command == "generate":
        argv += ["--prompt", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "huggingface-cli download meta-llama/Llama-3.2-1B" in err
    assert err.startswith(f"pd {command}: error:")


def test_a_missing_directory_is_named(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no model directory at" in capsys.readouterr().err


def test_vllm_spellings_parse(tiny_model_dir):
    args = build_parser("serve").parse_args(["serve", str(tiny_model_dir),
                                             "--gpu-memory-utilization", "0.5",
                                             "--no-enable-prefix-caching"])
    assert args.model_dir == str(tiny_model_dir)
    args.model = args.model_dir
    cfg = engine_config(args)
    assert cfg.gpu_memory_fraction == 0.5 and not cfg.enable_prefix_caching


def test_launch_refuses_a_busy_port_before_starting_nodes(tiny_model_dir, capsys):
    from pd.wire import security

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["launch", "--model", str(tiny_model_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "node" not in err
    assert security.active() is None  # no keys made, none left configured in this process
