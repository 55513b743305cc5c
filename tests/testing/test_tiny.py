"""pd.testing.tiny checkpoints: the file format, determinism, and loading by transformers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pd.testing.tiny import ENDOFTEXT, IM_END, IM_START, main, write_tiny_checkpoint
from pd.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied-sharded": dict(arch="llama", tie_word_embeddings=True, sharded=True),
    "llama-rope-scaling": dict(arch="llama", rope_scaling=LLAMA3_ROPE, mtp=False),
    "qwen2-sharded3": dict(arch="qwen2", sharded=3),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied-sharded-headdim": dict(arch="qwen3", tie_word_embeddings=True, sharded=True,
                                       head_dim=32, num_heads=4, num_kv_heads=1),
    "qwen2-bf16-padded-vocab": dict(arch="qwen2", dtype="bfloat16", vocab_size=640, seed=3),
}


def read_weights(path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_loads_and_logits_are_not_degenerate(make_tiny_model, variant):
    kwargs = dict(VARIANTS[variant])
    path = make_tiny_model(**kwargs)
    weights = read_weights(path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    mtp_keys = {k for k in weights if k.startswith("mtp.")}
    assert set(info["unexpected_keys"]) == mtp_keys
    assert bool(mtp_keys) == kwargs.get("mtp", True)

    # every parameter transformers uses came from the file, none from its own init
    state = model.state_dict()
    for name, tensor in weights.items():
        if name in state:
            torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0)
    if kwargs.get("tie_word_embeddings"):
        assert "lm_head.weight" not in weights
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    rope = model.config.rope_parameters
    assert rope["rope_type"] == ("llama3" if "rope_scaling" in kwargs else "default")
    assert rope["rope_theta"] == 10000.0

    prompt = torch.tensor([[17, 200, 31, 400, 5, 77, 311, 90]])
    with torch.no_grad():
        logits = model(prompt).logits[0]
    assert logits.shape == (8, kwargs.get("vocab_size", 512))
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.3
    assert len(set(logits.argmax(-1).tolist())) >= 4
    out = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, 8:].tolist()
    assert len(set(out)) >= 3, out


def test_format(make_tiny_model):
    path = make_tiny_model("qwen2", sharded=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["rope_scaling"] is None
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 128, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["torch_dtype"] == "float32" and cfg["vocab_size"] == 512

    index = json.loads((path / "model.safetensors.index.json").read_text())
    weights = read_weights(path)
    assert set(index["weight_map"]) == set(weights)
    assert len(set(index["weight_map"].values())) == 2
    assert not (path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in weights.values())

    h = 64
    assert weights["mtp.eh_proj.weight"].shape == (h, 2 * h)
    assert weights["mtp.enorm.weight"].shape == weights["mtp.hnorm.weight"].shape == (h,)
    layer0 = {k.removeprefix("model.layers.0."): v for k, v in weights.items()
              if k.startswith("model.layers.0.")}
    mtp_layer = {k.removeprefix("mtp.layer."): v for k, v in weights.items()
                 if k.startswith("mtp.layer.")}
    assert {k: v.shape for k, v in layer0.items()} == {k: v.shape for k, v in mtp_layer.items()}
    assert {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"} <= set(
        layer0)
    assert not torch.equal(layer0["self_attn.q_proj.weight"], mtp_layer["self_attn.q_proj.weight"])

    tok = Tokenizer.from_dir(path)
    gen = json.loads((path / "generation_config.json").read_text())
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    assert gen["eos_token_id"] == [eot, im_end] and tok.eos_token_ids == (eot, im_end)
    assert cfg["eos_token_id"] == cfg["bos_token_id"] == eot
    assert tok.token_to_id(IM_START) is not None and tok.vocab_size == 512
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tok_cfg["pad_token"] == ENDOFTEXT
    assert "<|im_start|>" in tok_cfg["chat_template"]


def test_arch_specific_names(make_tiny_model):
    llama = read_weights(make_tiny_model("llama"))
    qwen3 = read_weights(make_tiny_model("qwen3"))
    assert not any(k.endswith(".bias") for k in llama)
    assert not any("q_norm" in k for k in llama)
    assert not any(k.endswith(".bias") for k in qwen3)
    assert qwen3["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert "mtp.layer.self_attn.k_norm.weight" in qwen3
    assert "lm_head.weight" in llama


def test_deterministic_given_seed(tmp_path):
    a = read_weights(write_tiny_checkpoint(tmp_path / "a", "qwen3", seed=7))
    b = read_weights(write_tiny_checkpoint(tmp_path / "b", "qwen3", seed=7))
    c = read_weights(write_tiny_checkpoint(tmp_path / "c", "qwen3", seed=8))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_full_vocab_checkpoint_has_a_token_for_every_id(tmp_path):
    """`full_vocab`: the tokenizer is trained to the model's vocabulary, special tokens first,
    not padded; transformers reads it back with every id."""
    from transformers import PreTrainedTokenizerFast

    from pd.testing.tiny import SPECIAL_TOKENS

    path = write_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=768, full_vocab=True,
                                 mtp=False)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert len(tok) == 768 == json.loads((path / "config.json").read_text())["vocab_size"]
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


def test_fixtures_are_cached(make_tiny_model, tiny_model_dir):
    assert make_tiny_model() == tiny_model_dir == make_tiny_model("llama", mtp=True)
    assert make_tiny_model("qwen2") != tiny_model_dir
    assert json.loads((tiny_model_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    main([str(out), "--arch", "qwen3", "--shards", "3", "--no-mtp", "--dtype", "bfloat16",
          "--hidden-size", "32", "--num-layers", "3"])
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["torch_dtype"] == "bfloat16"
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 3
    assert "num_nextn_predict_layers" not in cfg
    weights = read_weights(out)
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not any(k.startswith("mtp.") for k in weights)


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="gpt2"), "arch"),
    (dict(vocab_size=100), "vocab_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(dtype="int8"), "dtype"),
    (dict(sharded=1), "sharded"),
])
def test_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_tiny_checkpoint(tmp_path, **kwargs)
