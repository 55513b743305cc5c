"""On a CUDA machine: the engine's greedy tokens must be reproducible, and sound, however many of
the GPU's multiprocessors it gets. The same requests (mixed prompt and output lengths, run
together by `Engine.generate`, twice) in a child process without MPS, then under an MPS daemon
of this check alone at each share of the multiprocessors given
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, as `nvidia-cuda-mps-control` lets a client be limited). A
run fails where its two passes differ (a race) or where fewer than `FIRST_EQUAL` of its
requests' first tokens equal those of the run without MPS (logits gone wrong: with fewer
multiprocessors cuBLAS may choose other kernels, whose roundings can move a greedy token near a
tie, so later tokens are compared for information only). With --switches, a failing share runs
again with each kernel family off in turn (PD_PDL=0, PD_ATTENTION=torch, PD_TRITON=0, then
PD_TRITON_OFF naming each Triton kernel alone), each against the same switch without MPS, to
name the kernel. With --nan-trace (eager), every module's output is checked for NaN and
infinities, and a run that had one fails, naming the first modules. A run the engine refuses to
start (`pd.engine.device_check`: its 16-bit products came out wrong under that share, as
cuBLAS's did on an H100 at 75%) passes: nothing wrong was computed. Exits 1 where a run fails.

    python benchmarks/gpu/check_sm_share.py [--percents 90 75 50 25] [--switches] [--synthetic-1b]
                                            [--eager] [--nan-trace]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile

FIRST_EQUAL = 0.9  # share of first tokens a run must have equal to the run without MPS

# each kernel family off in turn: the launch mode, the attention, every other Triton kernel,
# then each of those alone (`pd_kernels.triton_support`)
SWITCHES = ({"PD_PDL": "0"}, {"PD_ATTENTION": "torch"}, {"PD_TRITON": "0"}, *(
    {"PD_TRITON_OFF": name} for name in ("rms_norm", "rope_cache", "activation", "skinny_linear",
                                         "argmax", "masked_argmax", "token_logprob", "token_mask")))


def child(args) -> None:
    """Print one JSON line: the multiprocessors torch sees and each pass's tokens."""
    import torch

    from pd.config import EngineConfig, default_model_dir
    from pd.engine.engine import Engine
    from pd.wire.sampling_params import SamplingParams

    model = str(default_model_dir())
    if args.synthetic_1b:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_decode import LLAMA_1B  # noqa: PLC0415

        from pd.testing.tiny import write_tiny_checkpoint  # noqa: PLC0415

        model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-sm-share-"), "llama",
                                          mtp=False, dtype="bfloat16", **LLAMA_1B))
    # NOTE: no prefix cache: the second pass computes what the first did (cached prompts would
    # change its prefill steps, and bf16 rounding with them)
    engine = Engine(EngineConfig(model=model, device=args.device, dtype="bfloat16", num_blocks=2048,
                                 max_num_seqs=64, max_model_len=1024, enable_prefix_caching=False,
                                 enforce_eager=args.eager or args.nan_trace))
    found = []  # with --nan-trace: the first modules whose outputs held a NaN or an infinity
    if args.nan_trace:
        def check(name):
            def hook(module, inputs, out):
                outs = out if isinstance(out, tuple) else (out,)
                if len(found) < 5 and any(isinstance(t, torch.Tensor) and t.is_floating_point()
                                          and not bool(torch.isfinite(t).all()) for t in outs):
                    found.append(name or "model")
            return hook

        for name, module in engine.runner.model.named_modules():
            module.register_forward_hook(check(name))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.choice([1, 5, 16, 17, 60, 150]))]
               for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
              for _ in range(args.requests)]
    passes = [[r.output_token_ids for r in engine.generate(prompts, params)] for _ in range(2)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device != "cpu" else 0
    print(json.dumps({"sms": sms, "passes": passes, "nan": found}))


def run(env: dict, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--requests", str(args.requests)]
    cmd += [f"--{flag.replace('_', '-')}" for flag in ("synthetic_1b", "eager", "nan_trace")
            if getattr(args, flag)]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def report(label: str, got: dict, ref: list | None) -> bool:
    """One line for a run, its tokens against `ref` (the first pass without MPS); True where it
    ran, its two passes agree, enough of its first tokens equal `ref`'s and (with --nan-trace)
    no module gave a NaN or an infinity."""
    if "error" in got:
        if "DeviceCheckError" in got["error"]:  # the engine's start-up check: nothing computed
            print(f"{label:<44} refused at start: {got['error'].split(': ', 1)[-1][:150]}")
            return True
        print(f"{label:<44} failed: {got['error']}")
        return False
    first, second = got["passes"]
    digest = hashlib.sha256(json.dumps(first).encode()).hexdigest()[:12]
    ref = first if ref is None else ref
    same = sum(a == b for a, b in zip(first, ref))
    heads = sum(a[:1] == b[:1] for a, b in zip(first, ref))
    stable = first == second
    print(f"{label:<44} SMs {got['sms']:>4} | tokens {digest} | equal to no MPS: first tokens "
          f"{heads}/{len(first)}, all {same}/{len(first)} | two passes equal {stable}"
          + (f" | not finite first in {', '.join(got['nan'])}" if got.get("nan") else ""))
    return stable and heads >= FIRST_EQUAL * len(first) and not got.get("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split(". ")[0] + ".")
    p.add_argument("--percents", type=int, nargs="+", default=[90, 75, 50, 25],
                   help="shares of the multiprocessors to run at, after 100 (default: 90 75 50 25)")
    p.add_argument("--switches", action="store_true",
                   help="a failing share runs again with each kernel family off")
    p.add_argument("--synthetic-1b", action="store_true",
                   help="the Llama-3.2-1B shape, random bf16 (default: the embedded model)")
    p.add_argument("--requests", type=int, default=64, help="requests per pass (default: 64)")
    # the child's device (cpu: a dry run of the child on a machine without a GPU)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    p.add_argument("--nan-trace", action="store_true",
                   help="eager, every module's output checked for NaN and infinities: the first "
                        "modules that gave one are printed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from pd.service.mps import MPSDaemon

    base = run({}, args)
    ok = report("no MPS", base, None)
    ref = base.get("passes", [None])[0]
    mps = MPSDaemon()
    env = mps.start()
    try:
        for pct in [100, *args.percents]:
            share = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}
            good = report(f"MPS, {pct}% of the multiprocessors", run(share, args), ref)
            ok &= good
            if not good and args.switches:
                for switch in SWITCHES:  # against the same switch without MPS (its roundings)
                    name = " ".join(f"{k}={v}" for k, v in switch.items())
                    alone = run(switch, args)
                    report(f"  no MPS with {name}", alone, None)
                    report(f"  {pct}% with {name}", run({**share, **switch}, args),
                           alone.get("passes", [None])[0])
    finally:
        mps.stop()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
