"""Serving throughput through `pd launch` (router, one prefill and one decode node): `pd bench`
at one concurrency, and beside it the decode node's mean step time and batch size from its own
metrics, so that the serving path can be held against the engine.

    python benchmarks/bench_serving.py                                  # CPU, the embedded model
    python benchmarks/bench_serving.py --device cuda --synthetic-1b     # random Llama-3.2-1B shape

A warm-up run comes first (--warmup prompts); the nodes' figures (decode step and batch, a
request's way in, the decode loop's host time per step by phase, the device's step gap, the
prefill node's steps (prompts per step, their share of the run's time), the
share over 2.5 and 5 ms of the decode node's steps, of its intervals between sends, of the
router's gaps and of the client's: where the inter-token tail comes from; the share of first tokens and of gaps over 100 ms as the client,
the router and the prefill node saw them: where the far tail arises) are the measured run's
alone. --router-workers N serves through N router processes, --client-processes N measures
with N client processes.

Beside the figures: how busy each process was over the run (CPU seconds per second of wall:
1.0 is one core flat out), the router (inside `pd launch`, or each worker), each node and this
client; with --profile-router the router's hottest functions (cProfile, which slows it down,
one router process only); with --spy S
(`py-spy` on PATH) S seconds of samples of the router and both nodes from the middle of
the run, each process's threads and its hottest frames (py-spy barely slows them).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from bench_prefix_cache import launch, run_bench  # noqa: E402
from node_metrics import node_log_lines, snapshot  # noqa: E402
from proc_probes import children_cpu, cpu_seconds, spy  # noqa: E402
from pd.config import default_model_dir  # noqa: E402
from pd.service import trace  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks of each node and of the engine alone (default: 4096, or room "
                        "for every request in flight at once with a quarter to spare: at "
                        "concurrency 256, 272-token requests need 4352 16-token blocks)")
    p.add_argument("--synthetic-1b", action="store_true",
                   help="a random bf16 Llama-3.2-1B-shaped checkpoint with the tiny tokenizer's "
                        "512-token vocabulary")
    p.add_argument("--launch-args", default="",
                   help="more pd launch flags, one string (e.g. '--prefill-max-num-batched-tokens "
                        "256')")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="pd bench --random-range-ratio (0: every request the same length, so "
                        "the batch's requests end together and the batch refills in waves)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="prompts (16 tokens out) sent before the measured run, so that the "
                        "prefill graphs of its shapes are captured; the nodes' figures are the "
                        "measured run's alone (default: 2 x --concurrency)")
    p.add_argument("--router-workers", type=int, default=1,
                   help="pd launch --router-workers: router processes on the port")
    p.add_argument("--profile-router", type=int, default=0, metavar="N",
                   help="profile the router and print its N hottest functions")
    p.add_argument("--spy", type=float, default=0, metavar="S",
                   help="sample the router and the nodes with py-spy for S seconds")
    p.add_argument("--spy-focus", default="", metavar="NAME",
                   help="with --spy: also the frames with the most samples of their own under a "
                        "frame whose text holds NAME (e.g. 'DecodeLoop.launch')")
    p.add_argument("--spy-args", default="", metavar="ARGS",
                   help="more py-spy record flags, one string (e.g. '--idle': samples of "
                        "waiting threads too; '--native': native frames, pausing the process at "
                        "each sample)")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="pd bench --client-processes: the measured run's client split among N "
                        "processes (its CPU use, summed, is the client's)")
    p.add_argument("--result-json", default=None, metavar="PATH",
                   help="write the measured run's pd bench result there (per-request TTFTs and "
                        "inter-token gaps)")
    p.add_argument("--trace", action="store_true",
                   help="trace each request's way to its first token through every process "
                        "(PD_TRACE_REQUESTS) and print each hop's p50 / p90 / p99 / max")
    p.add_argument("--slow-ms", type=float, default=0, metavar="MS",
                   help="the nodes warn of each turn of their loop over MS ms with its phases "
                        "(PD_LOG_SLOW_STEPS_MS); the measured run's warnings are counted by node "
                        "and the slowest printed")
    p.add_argument("--no-engine", action="store_true",
                   help="skip the engine-alone run (pd.LLM, batch = --concurrency) it is held against")
    args = p.parse_args()
    if args.num_blocks is None:
        longest = (args.input_len + args.output_len) * (1 + args.range_ratio)
        per_request = -(-int(longest) // 16)
        args.num_blocks = max(4096, args.concurrency * per_request * 5 // 4)
    if args.synthetic_1b:
        from bench_decode import LLAMA_1B

        from pd.testing.tiny import write_tiny_checkpoint

        args.model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-serving-"), "llama",
                                               mtp=False, dtype="bfloat16",
                                               **{**LLAMA_1B, "vocab_size": 512}))
    profile = tempfile.mktemp(suffix=".prof") if args.profile_router else ""
    trace_dir = tempfile.mkdtemp(prefix="pd-trace-") if args.trace else None
    if trace_dir:
        os.environ[trace.ENV] = trace_dir  # the launched processes inherit it
    if args.slow_ms:
        os.environ["PD_LOG_SLOW_STEPS_MS"] = str(args.slow_ms)
    os.environ["PD_ROUTER_PROFILE"] = profile
    lau = launch(args, "--router-workers", str(args.router_workers), *shlex.split(args.launch_args))
    pids = {"router": lau.proc.pid, **{f"router-{i}": pid for i, pid in enumerate(lau.router_pids)},
            **{name: n["pid"] for name, n in lau.nodes.items()}}
    try:
        warmup = 2 * args.concurrency if args.warmup is None else args.warmup
        if warmup:
            run_bench(lau, args, "--num-prompts", str(warmup), "--random-input-len",
                      str(args.input_len), "--random-output-len", "16", "--max-concurrency",
                      str(args.concurrency), "--seed", "4")
        first = snapshot(lau)
        lines_before = len(lau.lines)
        measured_from = time.monotonic()
        logs_at = {n["log"]: os.path.getsize(n["log"]) for n in lau.nodes.values() if n.get("log")}
        before, wall = {k: cpu_seconds(pid) for k, pid in pids.items()}, time.perf_counter()
        own = time.process_time() + children_cpu()
        spies = spy(args.spy, {k: pids[k] for k in (
            "router" if not lau.router_pids else "router-0", "prefill-0", "decode-0")},
            extra=args.spy_args.split(), focus=args.spy_focus) if args.spy else []
        r = run_bench(lau, args, "--num-prompts", str(args.num_prompts),
                      "--random-input-len", str(args.input_len),
                      "--random-output-len", str(args.output_len),
                      "--max-concurrency", str(args.concurrency), "--seed", "3",
                      "--random-range-ratio", str(args.range_ratio),
                      "--client-processes", str(args.client_processes))
        wall = time.perf_counter() - wall
        # the measured run's lines of pd launch and of the nodes' logs
        lines = lau.lines[lines_before:] + node_log_lines(logs_at)
        # NOTE: the nodes log their captures at info: --launch-args '--log-level info'
        captures = Counter(line.split("captured a ")[1].split(" CUDA graph")[0]
                           for line in lines if "captured a " in line)
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(r, f)
        busy = {k: (cpu_seconds(pid) - before[k]) / wall for k, pid in pids.items()}
        # the client: this process, and its client processes once they have ended
        busy["client"] = (time.process_time() + children_cpu() - own) / wall
        for t in spies:
            t.join()
        last = snapshot(lau)

        def delta(role: str, name: str) -> float:  # over the measured run
            return last.get((role, name), 0.0) - first.get((role, name), 0.0)

        def mean(role: str, name: str) -> float:  # ms
            return 1000 * delta(role, name + "_sum") / max(delta(role, name + "_count"), 1.0)

        step = mean("decode", "pd_step_duration_seconds")
        device_step = mean("decode", "pd_decode_step_device_seconds")
        batch = mean("decode", "pd_batch_size") / 1000
        life = {name: mean(role, metric) for name, role, metric in (
            ("router admission queue", "router", "pd_request_queue_time_seconds"),
            ("router dispatch -> first token read", "router", "pd_router_first_token_nodes_seconds"),
            ("prefill arrival -> first token sent", "prefill", "pd_first_token_send_seconds"),
            ("RequestMeta -> first token in (decode)", "decode", "pd_first_token_receive_seconds"),
            ("prefill step", "prefill", "pd_step_duration_seconds"),
            ("KV send -> ack", "prefill", "pd_kv_transfer_seconds"),
            ("KV accept -> last record in (decode)", "decode", "pd_kv_transfer_seconds"),
            ("first token -> joined the batch", "decode", "pd_request_join_seconds"))}
        steps = delta("decode", "pd_batch_size_count")
        # the prefill node's share of the GPU it shares with the decode node: its steps (each
        # reads every weight once), prompts per step, and their wall time per second of the run
        prefill_steps = delta("prefill", "pd_batch_size_count")
        prefill = (prefill_steps, delta("prefill", "pd_batch_size_sum") / max(prefill_steps, 1.0),
                   delta("prefill", "pd_step_duration_seconds_sum") / wall)
        host = {k[1].split('"')[1]: 1000 * delta(*k) / max(steps, 1.0)
                for k in last if k[0] == "decode" and k[1].startswith("phase=")}
        host["sum"] = sum(host.values())
        gap = mean("decode", "pd_decode_step_gap_seconds")
        collected = {role: (delta(role, "pd_gc_pause_seconds_count"),
                            1000 * delta(role, "pd_gc_pause_seconds_sum"))
                     for role in ("prefill", "decode")}

        def steps_over(bound: str) -> float:  # share of the decode node's steps longer
            return 1 - (delta("decode", f'step_le="{bound}"')
                        / max(delta("decode", "pd_step_duration_seconds_count"), 1.0))

        def over(role: str, name: str, bound: str) -> float:  # share of a histogram's samples
            return 1 - delta(role, f'{name}_le="{bound}"') / max(delta(role, name + "_count"), 1.0)

        # a gap of the client's that no decode step explains arose on the way: in the decode
        # node's loop around its steps (its sends' pace), at the router (its gaps between the
        # deltas it writes) or after it (the client's reading)
        flat = [g for one in r["itls"] for g in one]
        tail = {b: (steps_over(b), over("decode", "pd_token_send_interval_seconds", b),
                    over("router", "pd_inter_token_latency_seconds", b),
                    sum(g > float(b) for g in flat) / max(1, len(flat)))
                for b in ("0.0025", "0.005")}

        # the means above hold the first wave's long waits: shares within bounds besides
        within = {f"{name} within {float(b) * 1e3:g} ms": 1 - over(role, metric, b)
                  for name, role, metric, bounds in (
                      ("first token sent", "prefill", "pd_first_token_send_seconds", ("0.005", "0.01")),
                      ("joined", "decode", "pd_request_join_seconds", ("0.001", "0.0025")))
                  for b in bounds}
        # where the slowest first tokens and gaps arise: the client's against the router's own
        # (arrival to the first token written; its gaps between tokens written) and the
        # prefill node's (arrival to the first token sent)
        slow = (sum(t > 0.1 for t in r["ttfts"]) / max(1, len(r["ttfts"])),
                over("router", "pd_time_to_first_token_seconds", "0.1"),
                over("router", "pd_request_queue_time_seconds", "0.1"),
                over("router", "pd_router_first_token_nodes_seconds", "0.1"),
                over("prefill", "pd_first_token_send_seconds", "0.1"),
                over("decode", "pd_first_token_receive_seconds", "0.1"),
                sum(g > 0.1 for g in flat) / max(1, len(flat)),
                over("router", "pd_inter_token_latency_seconds", "0.1"))
    finally:
        lau.stop()
    print(f"{args.device}: {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, concurrency {args.concurrency}: "
          f"{r['output_throughput']:.0f} output tok/s, TPOT p50 {r['median_tpot_ms']:.2f} ms, "
          f"ITL p50 / p99 {r['median_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} ms; decode node: "
          f"step {step:.2f} ms (on the device {device_step:.2f}), batch {batch:.1f}", flush=True)
    if not args.no_engine:
        alone, alone_step = engine_alone(args)
        print(f"engine alone ({args.device}, batch {args.concurrency}, {args.output_len} out): "
              f"{alone:.0f} tok/s, decode step on the device {alone_step:.2f} ms; served / engine "
              f"= {r['output_throughput'] / alone:.2f}", flush=True)
    print(f"TTFT p50 / p99 {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} ms; " + gaps(r["itls"]),
          flush=True)
    print("a request's way in, means (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in life.items()),
          flush=True)
    print("a request's way in, shares: " + ", ".join(f"{k} {v:.0%}" for k, v in within.items()),
          flush=True)
    print(f"decode node per step (ms): step gap {gap:.3f} on the device; host " + ", ".join(
        f"{k} {v:.3f}" for k, v in host.items()) + f"; {steps:.0f} steps, the run's "
        f"{1000 * r['duration'] / max(steps, 1.0):.3f} ms per step", flush=True)
    print(f"prefill node: {prefill[0]:.0f} steps, {prefill[1]:.1f} prompts per step, its steps "
          f"{prefill[2]:.0%} of the run's time", flush=True)
    print("the tail: " + ", ".join(
        f"over {float(b) * 1e3:g} ms {node:.2%} of the decode node's steps, {sends:.2%} of its "
        f"intervals between sends, {router:.2%} of the router's gaps, {client:.2%} of the "
        f"client's" for b, (node, sends, router, client) in tail.items()), flush=True)
    print(f"over 100 ms: first tokens {slow[0]:.2%} at the client, {slow[1]:.2%} at the router "
          f"({slow[2]:.2%} in its admission queue, {slow[3]:.2%} from its dispatch to the first "
          f"token read back), {slow[4]:.2%} at the prefill node, {slow[5]:.2%} at the decode node "
          f"(from its RequestMeta); gaps {slow[6]:.3%} at the client, {slow[7]:.3%} at the "
          f"router", flush=True)
    print("busy (CPU s per s): " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()), flush=True)
    print("garbage collections (generations 1-2) in the measured run: " + ", ".join(
        f"{role} node {n:.0f}, {ms:.1f} ms in all" for role, (n, ms) in collected.items()),
        flush=True)
    if captures:
        print("CUDA graphs captured during the measured run: " + ", ".join(
            f"{n} {kind}" for kind, n in captures.items()), flush=True)
    for t in spies:
        print(t.summary, flush=True)
    if trace_dir:
        print_hops(trace.hops(trace_dir, measured_from))
        shutil.rmtree(trace_dir, ignore_errors=True)
    if args.slow_ms:
        print_slow(lines)

    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_router)
        os.unlink(profile)


def print_slow(lines: list[str], top: int = 6) -> None:
    """The nodes' slow-step warnings of the measured run: how many per node, the slowest."""
    slow = [(float(m.group(2)), m.group(1), line[m.start():].strip()) for line in lines
            if (m := re.search(r"(\w+ node \S+): slow step, ([\d.]+) ms", line))]
    counts = Counter(node for _, node, _ in slow)
    print("slow steps: " + (", ".join(f"{node} {n}" for node, n in counts.items()) or "none"),
          flush=True)
    for _, _, line in sorted(slow, reverse=True)[:top]:
        print(f"  {line[:200]}", flush=True)


def print_hops(hops: dict[str, list[float]]) -> None:
    """Each hop of the traced requests' way to their first token: p50 / p90 / p99 / max, ms."""
    n = len(next(iter(hops.values()), []))
    print(f"a request's way to its first token, hop by hop ({n} requests traced; ms p50 / p90 / "
          f"p99 / max):", flush=True)
    for name, seconds in hops.items():
        s = sorted(seconds) or [0.0]

        def q(f: float) -> float:
            return 1000 * s[min(len(s) - 1, int(f * len(s)))]

        print(f"  {name:42s} {q(0.5):7.2f} {q(0.9):7.2f} {q(0.99):7.2f} {1000 * s[-1]:7.2f}",
              flush=True)


def engine_alone(args) -> tuple[float, float]:
    """Output tokens/s of pd.LLM on the same model, `concurrency` prompts of `input_len` random
    ids decoding `output_len` tokens at once (the figure serving is held against), and the mean
    device time of that run's decode steps in ms (its loop's CUDA events)."""
    import random

    from pd.engine.llm import LLM
    from pd.wire.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device, num_blocks=args.num_blocks)
    rng = random.Random(3)
    vocab = min(llm.tokenizer.vocab_size, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.concurrency)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    best, device = 0.0, 0.0
    busy = llm.engine.loop.busy
    for _ in range(2):
        busy.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
        if rate > best:
            best, device = rate, 1000 * sum(busy) / max(1, len(busy))
    llm.engine.close()
    return best, device


def gaps(itls: list[list[float]]) -> str:
    """How the tokens reached the client: the share of gaps under 1 ms (tokens that came
    together) and one request's first gaps in ms."""
    flat = [g for one in itls for g in one]
    together = sum(g < 1e-3 for g in flat) / max(1, len(flat))
    one = max(itls, key=len) if itls else []
    return (f"{together:.0%} of the {len(flat)} gaps under 1 ms; one request's first gaps (ms): "
            + " ".join(f"{g * 1e3:.1f}" for g in one[:40]))


if __name__ == "__main__":
    main()
