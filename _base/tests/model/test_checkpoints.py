"""Real checkpoints load right or are refused.

Every directory here is written by transformers (`from_config(...).save_pretrained`, through
`pd.testing.hf.write_hf_checkpoint`), never by hand, so config.json carries what real ones carry
(transformers 5 writes `rope_parameters`). The matrix runs pd's greedy decoding against
transformers' own `generate` on the same directory: tokens equal, logprobs within 1e-4, for
each RoPE type in both key styles, tied and untied heads, GQA from 1 to 8 KV heads, biases,
sliding-window layers on a prompt longer than the window, a padded vocabulary, sharded
safetensors, bf16 on disk and block-quantized fp8. What pd does not model is refused with one
line naming the field, exit code 2, and no node serving it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd.config import ModelConfig, ModelConfigError
from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams
from pd.testing.hf import PARITY_MATRIX as MATRIX
from pd.testing.hf import transformers_greedy, write_hf_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5, 17, 42, 99, 3],
    [100, 200, 300, 400, 500, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [7],
]
STEPS = 24
@pytest.fixture(scope="module")
def make_hf(tmp_path_factory):
    cache = {}

    def make(name: str, **kwargs):
        if name not in cache:
            cache[name] = write_hf_checkpoint(tmp_path_factory.mktemp(name), **kwargs)
        return cache[name]

    return make


def check_parity(model_dir, llm_dir=None) -> None:
    llm = LLM(llm_dir or model_dir, num_blocks=64, dtype="float32")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ref_tokens, ref_logprobs = transformers_greedy(model_dir, prompt, STEPS)
        assert out.token_ids == ref_tokens
        assert len(set(ref_tokens)) > 2, "degenerate reference: the test would prove little"
        assert out.logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    llm.engine.allocator.check_integrity()


@pytest.mark.parametrize("name", list(MATRIX))
def test_greedy_matches_transformers(make_hf, name):
    model_dir = make_hf(name, **MATRIX[name])
    cfg = json.loads((model_dir / "config.json").read_text())
    style = MATRIX[name].get("rope_key", "rope_parameters").split(":")[0]
    assert style in cfg, f"the directory should carry {style}"
    if MATRIX[name].get("max_shard_size"):
        assert (model_dir / "model.safetensors.index.json").is_file()
    check_parity(model_dir)


def test_the_matrix_exercises_what_it_names(make_hf):
    """The cases above reach what they are named for: scaled RoPE past its original context,
    sliding windows shorter than the longest prompt, and a padded vocabulary."""
    longest = max(map(len, PROMPTS)) + STEPS
    for name, kwargs in MATRIX.items():
        cfg = ModelConfig.from_dir(make_hf(name, **kwargs))
        kind = (cfg.rope_scaling or {}).get("rope_type")
        if kind in ("llama3", "yarn"):
            assert cfg.rope_scaling["original_max_position_embeddings"] < longest
        if kind == "dynamic":
            assert cfg.max_position_embeddings < longest <= cfg.max_context_len
        if kwargs.get("sliding_window"):
            assert cfg.sliding_window < max(map(len, PROMPTS)) and cfg.sliding_layers
    qwen2 = ModelConfig.from_dir(make_hf("qwen2-yarn-legacy-sliding",
                                         **MATRIX["qwen2-yarn-legacy-sliding"]))
    assert qwen2.sliding_layers == (1,)


def _fp8_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantization as the official *-FP8 releases ship it."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, block, nc, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest value
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * block, nc * block)[:rows, :cols].contiguous(), scale.float()


def test_fp8_block_quantized_checkpoint_is_dequantized(make_hf, tmp_path):
    """An fp8 checkpoint serves the weights its scales describe: pd on the fp8 directory equals
    transformers on the same weights dequantized."""
    src = make_hf("qwen3-fp8-src", arch="qwen3", hidden_size=64, intermediate_size=96)
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            q, scale = _fp8_quantize(t.float(), 32)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            deq = q.float() * scale.repeat_interleave(32, 0)[:t.shape[0]].repeat_interleave(32, 1)[:, :t.shape[1]]
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = t
    assert any((dequantized[n] != tensors[n]).any() for n in tensors), "quantization changed nothing"
    save_file(quantized, fp8_dir / "model.safetensors")
    save_file(dequantized, ref_dir / "model.safetensors")
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    check_parity(ref_dir, llm_dir=fp8_dir)


# --- refusals -----------------------------------------------------------------------------

def _edit_config(model_dir, tmp_path, **changes):
    dst = tmp_path / "edited"
    dst.mkdir(parents=True)
    for f in model_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


REFUSED = {
    "longrope": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
                 "rope_parameters.rope_type='longrope'"),
    "unknown-rope-key": (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                               "factor": 2.0, "mystery": 1}),
                         "rope_parameters.mystery=1"),
    "partial-rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    "gptq": (dict(quantization_config={"quant_method": "gptq", "bits": 4}),
             "quantized (gptq) checkpoints are not supported"),
    "awq": (dict(quantization_config={"quant_method": "awq", "bits": 4}),
            "quantized (awq) checkpoints are not supported"),
    "fp8-per-tensor": (dict(quantization_config={"quant_method": "fp8"}),
                       "quantization_config.weight_block_size=None"),
    "activation": (dict(hidden_act="xielu"), "hidden_act='xielu'"),
    "softcapping": (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unmodelled_config_values_are_refused_by_name(make_hf, tmp_path, case):
    changes, message = REFUSED[case]
    model_dir = _edit_config(make_hf("llama", **MATRIX["llama"]), tmp_path, **changes)
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        ModelConfig.from_dir(model_dir)


def test_a_tensor_the_model_has_no_place_for_is_refused(make_hf, tmp_path):
    # e.g. an o_proj bias the loader would otherwise drop (attention_bias said false)
    model_dir = _edit_config(make_hf("llama", **MATRIX["llama"]), tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"does not know what to do with: "
                                               r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        LLM(model_dir, num_blocks=16)


def _pd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pd", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_refusal_is_one_line_and_exit_code_2_for_every_command(make_hf, tmp_path):
    model_dir = _edit_config(make_hf("llama", **MATRIX["llama"]), tmp_path,
                             quantization_config={"quant_method": "gptq", "bits": 4})
    runs = {
        "generate": _pd("generate", "--model", str(model_dir), "--prompt", "hi"),
        "prefill": _pd("prefill", "--model", str(model_dir), "--port", "0"),
        "launch": _pd("launch", "--model", str(model_dir), "--port", "0"),
    }
    for command, out in runs.items():
        assert out.returncode == 2, (command, out.stderr[-2000:])
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert lines == [f"pd {command}: error: config.json quantization_config.quant_method="
                         "'gptq': quantized (gptq) checkpoints are not supported"], command
        assert "PD_READY" not in out.stdout and "serving" not in out.stdout, command


# --- generation config and end of sequence -------------------------------------------------

def test_generation_config_defaults_fill_what_a_request_omits(make_hf):
    # top_k=1 makes sampling greedy: visible in the tokens, whatever the seed
    model_dir = make_hf("llama-topk1", arch="llama", generation={"do_sample": True, "top_k": 1, "temperature": 0.8})
    llm = LLM(model_dir, num_blocks=64)
    assert llm.sampling_defaults == {"top_k": 1, "temperature": 0.8}
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    inherited = llm.generate(PROMPTS, llm.default_sampling_params(max_tokens=16, seed=3,
                                                                  ignore_eos=True))
    assert [o.token_ids for o in inherited] == [o.token_ids for o in greedy]
    plain = LLM(model_dir, num_blocks=64, generation_config="vllm")
    assert plain.sampling_defaults == {}
    sampled = plain.generate(PROMPTS, plain.default_sampling_params(max_tokens=16, seed=3,
                                                                    ignore_eos=True))
    assert [o.token_ids for o in sampled] != [o.token_ids for o in greedy]


def test_pd_generate_takes_the_generation_config_unless_a_flag_says_otherwise(make_hf, capsys):
    from pd.cli.main import main

    model_dir = make_hf("llama-topk1", arch="llama", generation={"do_sample": True, "top_k": 1, "temperature": 0.8})
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "5,17,42", "--max-tokens", "12",
            "--ignore-eos", "--json", "--seed", "1"]

    def generate(*extra: str) -> dict:  # the command in this process (three interpreters took 15 s)
        assert main([*args, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    default, greedy, sampled = generate(), generate("--temperature", "0"), generate("--top-k", "0")
    assert default["token_ids"] == greedy["token_ids"] != sampled["token_ids"]


def test_a_bad_generation_config_value_is_refused_by_name(make_hf, tmp_path):
    model_dir = _edit_config(make_hf("llama", **MATRIX["llama"]), tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    out = _pd("generate", "--model", str(model_dir), "--prompt", "hi")
    assert out.returncode == 2
    assert "generation_config.json: invalid sampling parameter top_p=1.5" in out.stderr


def test_without_generation_config_the_model_stops_at_config_eos(make_hf, tmp_path):
    from pd.text.tokenizer import Tokenizer

    model_dir = _edit_config(make_hf("llama", **MATRIX["llama"]), tmp_path, eos_token_id=7)
    (model_dir / "generation_config.json").unlink()
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = None
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert Tokenizer.from_dir(model_dir).eos_token_ids == (7,)
    llm = LLM(model_dir, num_blocks=64)
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    # make 7 the model's first choice somewhere: stop there instead
    prompt, out = next((p, o) for p, o in zip(PROMPTS, free) if len(set(o.token_ids)) > 2)
    eos = out.token_ids[3]
    model_dir2 = _edit_config(model_dir, tmp_path / "eos2", eos_token_id=eos)
    (model_dir2 / "generation_config.json").unlink(missing_ok=True)
    stopped = LLM(model_dir2, num_blocks=64).generate([prompt], SamplingParams(
        max_tokens=STEPS, temperature=0.0))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == out.token_ids[:out.token_ids.index(eos) + 1]
