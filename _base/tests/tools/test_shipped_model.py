"""The shipped default model `pd/assets/pd-tiny-code`: its files, a golden greedy completion
through `transformers`, and its MTP layer through the training model of `tools/tiny_lm.py`.

The golden texts and ids were recorded from the shipped weights; a change to the files or to
how they load shows up here. The serving engine's own check of the same model is its tests'."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.tiny_eval import draft, greedy, speculative  # noqa: E402
from tools.tiny_lm import TinyConfig, TinyLM  # noqa: E402

MODEL = ROOT / "pd" / "assets" / "pd-tiny-code"
PROMPT = "def fibonacci(n):"
GOLDEN = '\n    """\n    Return a list of all the results in the given list of all\n    elements.\n    """\n    if n'
MTP_PROMPT = "import os\nimport sys\n\n\ndef main(argv):"
GOLDEN_DRAFTS = [283, 441, 2544]  # '\n   ', ' """', 'Run'
EOS = {0, 2}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny_lm():
    cfg = json.loads((MODEL / "config.json").read_text())
    model = TinyLM(TinyConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
        rms_norm_eps=cfg["rms_norm_eps"]))
    state = {k: v.float() for k, v in load_file(str(MODEL / "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_files_and_size():
    names = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "metrics.json"} <= names
    assert (MODEL / "model.safetensors").stat().st_size <= 16 * 10**6
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["torch_dtype"] == "bfloat16"
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert gen["eos_token_id"] == sorted(EOS)


def test_card_states_the_measured_figures():
    card = (MODEL / "README.md").read_text()
    m = json.loads((MODEL / "metrics.json").read_text())
    assert f"{m['heldout']['perplexity']:.2f}" in card
    assert f"{m['heldout']['loss']:.4f}" in card
    for r in m["mtp_acceptance"]["by_k"].values():
        assert f"{r['mean_tokens_per_step']:.2f}" in card


def test_golden_completion_in_transformers(tokenizer):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:].tolist()) == GOLDEN


def test_training_model_reads_the_checkpoint_like_transformers(tiny_lm, tokenizer, one_thread):
    new = greedy(tiny_lm, tokenizer.encode(PROMPT).ids, 24, EOS)
    assert tokenizer.decode(new) == GOLDEN


def test_mtp_layer_drafts_and_is_accepted(tiny_lm, tokenizer, one_thread):
    prompt = tokenizer.encode(MTP_PROMPT).ids
    with torch.no_grad():
        assert draft(tiny_lm, prompt, 3) == GOLDEN_DRAFTS
    out, per_step = speculative(tiny_lm, prompt, 3, 32, EOS)
    assert out == greedy(tiny_lm, prompt, 32, EOS)
    assert sum(per_step) / len(per_step) >= 2.0  # random MTP weights give about 1.0
