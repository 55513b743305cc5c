"""Loading checkpoints: clear errors for what cannot be served, and `pd generate --json`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd.engine.llm import LLM
from pd.model.loader import load_model
from pd.wire.sampling_params import SamplingParams


def copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures='GPT2LMHeadModel': not supported"):
        load_model(model, dtype=torch.float32, device="cpu")


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model, dtype=torch.float32, device="cpu")


def test_wrong_shape_is_named(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* shape \(3,\)"):
        load_model(model, dtype=torch.float32, device="cpu")


def test_no_weights_is_a_clear_error(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(model, dtype=torch.float32, device="cpu")


def test_loading_and_running_a_model_imports_neither_dynamo_nor_fx():
    """Building the model on the meta device and giving it its tensors, then decoding, leave
    torch._dynamo and torch.fx's symbolic shapes unimported: either costs every node's start
    0.5-1.5 s on 2 cores (an embedding's random init and `to_empty` on meta imported them)."""
    code = ("import sys; from pd.engine.llm import LLM; from pd.wire.sampling_params import "
            "SamplingParams; LLM().generate([[5, 6, 7]], SamplingParams(max_tokens=4)); "
            "print(sorted(m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"]


def test_generate_cli_json(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "pd", "generate", "--model", str(tiny_model_dir),
         "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-tokens", "6", "--top-logprobs", "2",
         "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    ref = LLM(tiny_model_dir, num_blocks=64).generate(
        [[5, 6, 7], [9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    for row, want in zip(rows, ref):
        assert row["token_ids"] == want.token_ids
        assert row["logprobs"] == pytest.approx(want.logprobs, abs=1e-6)
        assert all(len(step) == 2 for step in row["top_logprobs"])
        assert row["text"] == want.text
    assert "tokens/s" in out.stderr


def test_generate_cli_bad_input_is_a_clear_error(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "pd", "generate", "--model", str(tiny_model_dir),
         "--prompt-ids", "5,99999", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "outside the vocabulary" in out.stderr and "Traceback" not in out.stderr
