"""Train the embedded default model: a small Llama with a DeepSeek-V3 style MTP layer, on the
Python source of the standard library of the interpreter that runs this script.

    python tools/train_tiny.py --out DIR [--device cuda] [--steps N | --time-budget S] ...
    python tools/train_tiny.py --out DIR --toy        # a few seconds on CPU (the test suite's)

Corpus: the stdlib's `.py` files, sorted, split into train / validation / held-out test by a
hash of each file's relative path (whole files). `--with-tests` adds the stdlib's own test
suite to the training side only. A byte-level BPE (`pd.testing.tiny.train_bpe_tokenizer`) is trained on
the training files. Loss: LM cross entropy + lambda * mean over MTP levels (level 1 is the
checkpoint's MTP entry, levels 2.. its chained use; see `tools/tiny_lm.py`). The checkpoint kept
is the one with the lowest validation loss. The output is a model directory in the project's
checkpoint format plus `metrics.json` (held-out loss and perplexity, greedy samples, greedy MTP
acceptance for k = 1, 2, 3), everything also printed.

Deterministic given the seed and a fixed `--steps` (bit for bit on CPU; up to kernel
nondeterminism on CUDA). With `--time-budget` and no `--steps`, the step count is set from the
measured speed, so it varies. Serving the result is left to the engine and the CLI.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd.testing.tiny import ENDOFTEXT, IM_END, train_bpe_tokenizer, write_config_files, write_tokenizer_files  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tools.tiny_eval import acceptance, greedy, heldout_loss  # noqa: E402
from tools.tiny_lm import TinyConfig, TinyLM  # noqa: E402

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
             "lib2to3", "turtledemo", "tkinter", "ensurepip", "encodings", "pydoc_data"}
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
TOY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2,
           seq_len=64, batch_size=8, steps=30, max_files=24, eval_tokens=2048, prompts=2,
           max_new=12, eval_every=10, lr=3e-3, device="cpu", compile=False, threads=1)


def split_of(rel: str) -> str:
    """Whole-file split by a stable hash of the path: 4% test, 4% validation, 92% train."""
    bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < 4 else "val" if bucket < 8 else "train"


def corpus(root: Path, with_tests: bool, max_files: int | None) -> dict[str, list[tuple[str, str]]]:
    out = {"train": [], "val": [], "test": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        dirs = set(rel.split("/")[:-1])
        is_test = bool(dirs & {"test", "tests"})
        if dirs & (SKIP_DIRS - {"test", "tests"}) or (is_test and not with_tests):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out["train" if is_test else split_of(rel)].append((rel, text))
    if max_files:
        out = {k: v[:max_files if k == "train" else max(1, max_files // 8)] for k, v in out.items()}
    return out


def encode(tok, files, eot: int) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch([t for _, t in files]):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def code_prompts(tok, files, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, each starting after a line break at evenly spaced points
    of the files (several points per file when there are fewer files than prompts)."""
    per_file = -(-n // max(1, len(files)))
    prompts = []
    for j in range(per_file):
        for _, text in files:
            cut = text.find("\n", len(text) * (j + 1) // (per_file + 1)) + 1
            ids = tok.encode(text[cut:]).ids[:length] if cut else []
            if len(ids) == length and len(prompts) < n:
                prompts.append(ids)
    return prompts


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, min(200, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


def hf_config(cfg: TinyConfig, eot: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": eot, "eos_token_id": eot,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 1,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--toy", action="store_true", help="tiny CPU preset for tests")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="training seconds at most")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mtp-lambda", type=float, default=0.3)
    p.add_argument("--mtp-depth", type=int, default=3, help="MTP levels trained (1 + chained)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                   help="standard-library tree to train on (default: the running Python's)")
    p.add_argument("--with-tests", action="store_true", help="train on the stdlib's tests too")
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=262144)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts for MTP acceptance")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.toy:
        for k, v in TOY.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.compile = a.device.startswith("cuda") if a.compile is None else a.compile
    if a.steps is None and a.time_budget is None:
        p.error("give --steps, --time-budget, or --toy")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    t_start = time.time()
    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    files = corpus(Path(a.stdlib), a.with_tests, a.max_files)
    tok = train_bpe_tokenizer([t for _, t in files["train"]], a.vocab_size)
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    data = {k: encode(tok, v, eot) for k, v in files.items()}
    print(f"corpus: {a.stdlib} (running Python {sys.version.split()[0]}); "
          + ", ".join(f"{k} {len(files[k])} files {len(data[k])} tokens" for k in data)
          + f"; tokenizer {time.time() - t_start:.1f}s", flush=True)

    cfg = TinyConfig(vocab_size=tok.get_vocab_size(), hidden_size=a.hidden_size,
                     intermediate_size=a.intermediate_size, num_layers=a.layers,
                     num_heads=a.heads, num_kv_heads=a.kv_heads,
                     max_position_embeddings=a.seq_len, dropout=a.dropout)
    model = TinyLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg}, {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=a.lr,
                            betas=(0.9, 0.95), fused=dev.type == "cuda")
    step_fn = torch.compile(model) if a.compile else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    train = data["train"].to(dev)
    row_len = a.seq_len + a.mtp_depth + 1
    gen = torch.Generator().manual_seed(a.seed)
    total = a.steps or 10**9
    best = (float("inf"), 0, None)
    tokens_per_step = a.batch_size * a.seq_len
    t_train, step, t_mark = time.time(), 0, None

    def validate():
        model.eval()
        with amp:
            v = heldout_loss(model, data["val"].to(dev), a.seq_len, a.batch_size, a.eval_tokens)
        model.train()
        return v["loss"]

    while step < total:
        if a.time_budget and time.time() - t_train > a.time_budget:
            print(f"time budget reached at step {step}", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total if total < 10**9 else 10**4, a.lr)
        starts = torch.randint(0, len(train) - row_len, (a.batch_size,), generator=gen)
        rows = torch.stack([train[s:s + row_len] for s in starts.tolist()])
        with amp:
            lm, mtp = step_fn(rows, a.seq_len, a.mtp_depth)
            loss = lm + a.mtp_lambda * sum(mtp) / len(mtp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 5:
            t_mark = time.time()
        if a.steps is None and step == 25:  # NOTE: steps from measured speed; not reproducible
            dt = (time.time() - t_mark) / 20
            total = max(step + 1, int((a.time_budget - (time.time() - t_train)) / dt) + step)
            print(f"{dt * 1e3:.1f} ms/step: planning {total} steps", flush=True)
        if step % a.eval_every == 0 or step == total:
            val = validate()
            if val < best[0]:
                best = (val, step, copy.deepcopy(model.state_dict()))
            el = time.time() - t_train
            ts = tokens_per_step * (step - 5) / (time.time() - t_mark) if t_mark and step > 5 else 0
            eta = (total - step) * el / step if total < 10**9 else float("nan")
            print(f"step {step}/{total} loss {loss.item():.4f} lm {lm.item():.4f} "
                  f"mtp {' '.join(f'{m.item():.3f}' for m in mtp)} val {val:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {ts / 1e3:.0f}k tok/s "
                  f"elapsed {el:.0f}s eta {eta:.0f}s", flush=True)
    train_seconds = time.time() - t_train
    if best[2] is None or best[1] != step:
        val = validate()
        if val < best[0]:
            best = (val, step, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[2])
    state = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    model = model.float().eval()
    with torch.no_grad():  # evaluate the weights as shipped: bf16, computed in float32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    print(f"kept step {best[1]} (val loss {best[0]:.4f}); evaluating", flush=True)

    eos = {eot, im_end}
    test = heldout_loss(model, data["test"].to(dev), a.seq_len, a.batch_size, a.eval_tokens)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        new = greedy(model, tok.encode(prompt).ids, a.max_new, eos)
        samples[prompt] = tok.decode(new)
        print(f"--- {prompt!r} ->\n{prompt}{samples[prompt]}", flush=True)
    prompts = code_prompts(tok, files["test"], a.prompts, 128 if not a.toy else 16)
    acc = acceptance(model, prompts, (1, 2, 3), a.max_new, eos)
    metrics = {
        "corpus": {"stdlib": a.stdlib, "python": sys.version.split()[0],
                   "with_tests": a.with_tests, **{f"{k}_files": len(v) for k, v in files.items()},
                   **{f"{k}_tokens": len(v) for k, v in data.items()}},
        "parameters": n_params, "weights_bytes": sum(t.numel() * 2 for t in state.values()),
        "config": vars(cfg), "args": {k: v for k, v in vars(a).items()},
        "steps": step, "kept_step": best[1], "val_loss": best[0],
        "train_tokens": step * tokens_per_step, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "heldout": test, "samples": samples,
        "mtp_acceptance": {"num_prompts": len(prompts), "max_new": a.max_new, "by_k": acc},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_config_files(out, hf_config(cfg, eot), [eot, im_end], bos_token_id=eot, pad_token_id=eot)
    write_tokenizer_files(out, tok, model_max_length=a.seq_len)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"heldout": test, "mtp_acceptance": acc}, indent=2), flush=True)
    return metrics


if __name__ == "__main__":
    main()
