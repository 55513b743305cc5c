"""`tools/train_tiny.py` end to end on its CPU `--toy` preset (a real, if tiny, training run into a
temporary directory), and the drafting and split logic it relies on."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.tiny_eval import acceptance, draft, greedy, speculative  # noqa: E402
from tools.tiny_lm import TinyConfig, TinyLM, chain_mask, rope_tables  # noqa: E402
from tools.train_tiny import SAMPLE_PROMPTS, split_of  # noqa: E402


def run_toy(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--toy", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept step" in proc.stdout
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    return out, run_toy(out)


def test_metrics_fields(toy):
    _, m = toy
    held = m["heldout"]
    assert held["tokens"] > 0 and 0 < held["loss"] < math.log(m["config"]["vocab_size"]) + 1
    assert held["perplexity"] == pytest.approx(math.exp(held["loss"]))
    assert math.isfinite(held["mtp_loss"])
    assert set(m["samples"]) == set(SAMPLE_PROMPTS)
    by_k = m["mtp_acceptance"]["by_k"]
    assert set(by_k) == {"1", "2", "3"} and m["mtp_acceptance"]["num_prompts"] > 0
    for k, r in by_k.items():
        assert r["matches_greedy"] is True
        assert 1.0 <= r["mean_tokens_per_step"] <= int(k) + 1
        assert len(r["acceptance_by_position"]) == int(k)
    assert m["steps"] == 30 and 0 < m["kept_step"] <= 30
    assert m["train_tokens"] == 30 * 8 * 64


def test_directory_loads_in_transformers(toy):
    out, m = toy
    transformers = pytest.importorskip("transformers")
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json"}
    assert names <= {p.name for p in out.iterdir()}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and tok_cfg["eos_token"] == "<|endoftext|>"

    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.weight" not in weights  # tied
    h = cfg["hidden_size"]
    assert weights["mtp.eh_proj.weight"].shape == (h, 2 * h)
    assert {f"mtp.layer.{k}.weight" for k in ("input_layernorm", "mlp.down_proj")} <= set(weights)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    max_new = m["args"]["max_new"]
    for prompt, want in m["samples"].items():
        ids = tok(prompt, return_tensors="pt").input_ids
        got = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        assert tok.decode(got[0, ids.shape[1]:]) == want, prompt


def test_deterministic_given_seed(toy, tmp_path):
    out, m = toy
    again = run_toy(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert again["heldout"] == m["heldout"]


def test_split_is_by_whole_file_and_stable():
    names = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(20)]
    splits = [split_of(n) for n in names]
    assert splits == [split_of(n) for n in names]
    share = {s: splits.count(s) / len(names) for s in ("train", "val", "test")}
    assert share["train"] > 0.8 and 0 < share["val"] < 0.1 and 0 < share["test"] < 0.1


def test_chain_mask():
    m = chain_mask(4, 3, "cpu")
    assert m.shape == (4, 12)
    assert m[2, :4].tolist() == [True, True, True, False]  # level-1 entries of origins <= 2
    assert m[2, 4:8].tolist() == [False, False, True, False]  # own level-2 entry only
    assert m[2, 8:].tolist() == [False, False, True, False]


@pytest.fixture
def one_thread():
    """Many tiny forwards run fastest single-threaded on a shared CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _random_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    model = TinyLM(cfg).eval()
    with torch.no_grad():  # larger weights than at init, so greedy outputs vary
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)
    return model


def test_speculative_equals_greedy_on_random_weights(one_thread):
    model = _random_lm()
    prompts = [torch.randint(3, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 7, 12)]
    for p in prompts:
        ref = greedy(model, p, 16, {0})
        for k in (1, 2, 3):
            out, per_step = speculative(model, p, k, 16, {0})
            assert out == ref
            assert all(1 <= s <= k + 1 for s in per_step)
    result = acceptance(model, prompts, (1, 3), 16, {0})
    assert all(r["matches_greedy"] for r in result.values())


def test_chained_drafts_match_incremental_mtp_cache(one_thread):
    """The drafts equal an inference-style chain: one query at a time over an MTP KV cache that
    holds the level-1 entries of the context and then each chained entry."""
    model = _random_lm(1)
    ids = torch.randint(3, 50, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    mtp, emb = model.mtp, model.model.embed_tokens
    with torch.no_grad():
        drafts = draft(model, ids, 3)
        x = torch.tensor([ids])
        n = len(ids) - 1  # origins 0..n-1 have both h_i and t_{i+1}
        h = model.hidden(x[:, :-1])
        cos, sin = rope_tables(model.cfg, torch.arange(n))
        e = mtp.eh_proj(torch.cat([mtp.enorm(emb(x[:, 1:])), mtp.hnorm(h)], -1))
        o, cache = mtp.layer(e, cos, sin)
        want, prev, tok = [], o[:, -1:], None
        want.append(int(model.logits(prev).argmax(-1)))
        for pos in (n, n + 1):
            tok = torch.tensor([[want[-1]]])
            cos, sin = rope_tables(model.cfg, torch.tensor([pos]))
            e = mtp.eh_proj(torch.cat([mtp.enorm(emb(tok)), mtp.hnorm(prev)], -1))
            mask = torch.ones(1, cache[0].shape[2] + 1, dtype=torch.bool)
            prev, kv = mtp.layer(e, cos, sin, past_kv=cache, mask=mask)
            cache = (torch.cat([cache[0], kv[0]], 2), torch.cat([cache[1], kv[1]], 2))
            want.append(int(model.logits(prev).argmax(-1)))
    assert drafts == want
