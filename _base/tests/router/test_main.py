"""The router's command line: flags, defaults, address checks, config derived from them."""

from __future__ import annotations

import pytest

from router import capacity
from router.main import build_parser, server_config


def test_flags_and_defaults(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    args = build_parser().parse_args([
        "--model", str(model), "--prefill", "127.0.0.1:7001", "h2:7002",
        "--decode", "127.0.0.1:7101", "--policy", "round_robin", "--api-key", "k"])
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 8000, "round_robin")
    assert args.prefill == ["127.0.0.1:7001", "h2:7002"] and args.decode == ["127.0.0.1:7101"]
    cfg = server_config(args)
    assert cfg.served_model_name == "my-model" and cfg.api_key == "k"
    args = build_parser().parse_args(["--model", str(model), "--served-model-name", "m"])
    assert server_config(args).served_model_name == "m"
    args = build_parser().parse_args(["--model", str(model), "--router-workers", "4"])
    assert args.router_workers == 4 and server_config(args, share=4).max_running == 128
    # each worker may fill its share of the decode nodes' KV (`router.capacity.budget`)
    share = server_config(args, share=4).kv_share
    assert share == 0.25 and capacity.budget([(100, 16), (60, 16)], share) == 640
    assert capacity.budget(None, share) is None
    assert capacity.kv_tokens([10, 40], 7, [(100, 16)]) == 32 + 48  # whole blocks
    assert capacity.kv_tokens([10, 40], None, [(100, 16)]) == 16 + 48  # prompt + one token


@pytest.mark.parametrize("bad", [["--prefill", "nohost"], ["--decode", "h:99999"],
                                 ["--policy", "fastest"], ["--router-workers", "0"],
                                 ["--router-workers", "two"], []])
def test_bad_flags(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m"] * (bad != []) + bad)


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--model", "--served-model-name", "--prefill", "--decode",
                 "--policy", "--max-queue", "--api-key", "--log-level", "--log-requests"):
        assert flag in out


def test_api_key_from_a_file_or_the_environment_not_argv(tmp_path, monkeypatch, caplog):
    model = tmp_path / "m"
    model.mkdir()
    monkeypatch.delenv("PD_API_KEY", raising=False)
    with caplog.at_level("WARNING", logger="router"):
        assert server_config(build_parser().parse_args(["--model", str(model), "--api-key", "k"])).api_key == "k"
    assert "visible to every local user" in caplog.text
    caplog.clear()
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    with caplog.at_level("WARNING", logger="router"):
        args = build_parser().parse_args(["--model", str(model), "--api-key-file", str(key_file)])
        assert server_config(args).api_key == "s3cret"
    monkeypatch.setenv("PD_API_KEY", "from-env")
    with caplog.at_level("WARNING", logger="router"):
        assert server_config(build_parser().parse_args(["--model", str(model)])).api_key == "from-env"
    assert "visible" not in caplog.text
    with pytest.raises(SystemExit, match="once"):
        server_config(build_parser().parse_args(["--model", str(model), "--api-key", "x",
                                                 "--api-key-file", str(key_file)]))
    key_file.write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        server_config(build_parser().parse_args(["--model", str(model), "--api-key-file", str(key_file)]))
