"""On a CUDA machine: greedy output of the engine with MTP (k = 1..4, bookkeeping in the
RawKernels) against the same engine without MTP, token for token, in float32 and bfloat16, with
the mean acceptance length; and the same with the torch twins (PD_KERNELS=torch).

    python benchmarks/gpu/check_mtp_engine.py
    PD_ATTENTION=torch python benchmarks/gpu/check_mtp_engine.py

Exit status: non-zero when a float32 output differs, and a bfloat16 one when both runs use one
attention implementation (PD_ATTENTION=torch). By default plain decode steps run the Triton
decode kernel while MTP verify steps (1 + k queries) run the torch path, and bf16 rounding of the
two differs, so near-ties can flip: those bf16 counts are printed, not judged.
"""

from __future__ import annotations

import os
import sys

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_mtp import PROMPTS  # noqa: E402


def main() -> int:
    bad = 0
    prompts = PROMPTS * 4
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=2)
    for dtype in ("float32", "bfloat16"):
        ref = LLM(device="cuda", dtype=dtype, num_blocks=1024).generate(prompts, params)
        for backend in ("cupy", "torch"):
            os.environ["PD_KERNELS"] = backend
            for k in (1, 2, 3, 4):
                llm = LLM(device="cuda", dtype=dtype, num_blocks=1024, num_speculative_tokens=k)
                out = llm.generate(prompts, params)
                same = sum(o.token_ids == r.token_ids for o, r in zip(out, ref))
                judged = dtype == "float32" or os.environ.get("PD_ATTENTION") == "torch"
                bad += judged and same != len(ref)
                print(f"{dtype:>8} {backend:>5} k={k}: {same}/{len(ref)} outputs equal to no-MTP, "
                      f"mean acceptance length {llm.engine.spec.stats.mean_acceptance_length:.2f}")
    os.environ.pop("PD_KERNELS", None)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
