"""On a CUDA machine: the checkpoint parity matrix through `pd generate --device cuda`.

Every case of `pd.testing.tiny.PARITY_MATRIX` (directories written by transformers: each RoPE type in
both key styles, tied/untied, GQA 1-8, biases, sliding windows, padded vocabulary, shards, bf16
on disk) is decoded greedily in float32 by `pd generate --device cuda --json` and by
transformers' `generate` on the CPU; tokens must be equal and logprobs within 1e-4.

    python benchmarks/gpu/check_checkpoints.py [cuda|cpu]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from pd.testing.hf import PARITY_MATRIX, transformers_greedy, write_hf_checkpoint

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

PROMPTS = [[5, 17, 42, 99, 3], [100, 200, 300, 400, 500, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                21, 22, 23], [7]]
STEPS = 24


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu" checks the script itself
    root = Path(tempfile.mkdtemp(prefix="pd-ckpt-"))
    failed = 0
    print(f"{'case':<34} | {'tokens equal':>12} | {'max |dlogprob|':>14}")
    for name, kwargs in PARITY_MATRIX.items():
        model_dir = write_hf_checkpoint(root / name, **kwargs)
        cmd = [sys.executable, "-m", "pd", "generate", "--model", str(model_dir), "--device", device,
               "--dtype", "float32", "--max-tokens", str(STEPS), "--temperature", "0",
               "--ignore-eos", "--top-logprobs", "1", "--json", "--num-blocks", "64"]
        for p in PROMPTS:
            cmd += ["--prompt-ids", ",".join(map(str, p))]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            print(f"{name:<34} | pd generate failed ({out.returncode}): {out.stderr[-400:]}")
            failed += 1
            continue
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        equal, worst = 0, 0.0
        for prompt, row in zip(PROMPTS, rows):
            tokens, logprobs = transformers_greedy(model_dir, prompt, STEPS)
            equal += row["token_ids"] == tokens
            worst = max([worst] + [abs(a - b) for a, b in zip(row["logprobs"], logprobs)])
        ok = equal == len(PROMPTS) and worst <= 1e-4
        failed += not ok
        print(f"{name:<34} | {equal:>5}/{len(PROMPTS):<6} | {worst:>14.2e}{'' if ok else '  FAILED'}")
    where = torch.cuda.get_device_name() if device.startswith("cuda") else device
    print(f"{len(PARITY_MATRIX) - failed}/{len(PARITY_MATRIX)} cases equal on {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
