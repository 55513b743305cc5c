"""Decode inter-token latency under a mixed load: prefill and decode on two GPUs (PD) beside one
colocated engine doing both, in one run.

The load: `--streams` steady decode streams (`--stream-prompt` random tokens of prompt,
`--stream-tokens` tokens each, EOS ignored), and in the mixed phase, besides them, prompts of
`--prompt-len` tokens arriving every `--interval` seconds (each asks for `--long-tokens`
tokens) until the streams end. Each setup runs the streams alone, then the mixed load. ITL is
every gap between two consecutive tokens of a steady stream (its first `--skip` tokens left
out), pooled: p50, p99 and max.

- PD: a prefill node on `--prefill-device` and a decode node on `--decode-device`, real
  processes joined by ZMQ and the KV transport (`--transports`: one row each, CUDA IPC and
  the shm ring by default on GPUs), driven by `pd.service.client.NodeClient`; a token's time is
  when the client receives it. The arriving prompts are sent and read by a second process
  (`Arrivals`), so the one stamping the streams' tokens does nothing else.
- colocated: one `Engine` on `--prefill-device` doing both, driven in this process (chunked
  prefill of up to `--max-num-batched-tokens` tokens per step, mixed into the decode steps); a
  token's time is when the step that sampled it returns.

The PD column carries one more hop (decode node -> client over ZMQ) than the colocated one; the
ratio that matters is each setup's mixed p99 over its own streams-alone p99.

    python benchmarks/gpu/bench_mixed.py                         (2 GPUs, random Llama-3.2-1B)
    python benchmarks/gpu/bench_mixed.py --tiny --prefill-device cpu --decode-device cpu
        --prompt-len 1024 --streams 4 --stream-tokens 64          (a quick CPU check of the script)
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_decode import LLAMA_1B  # noqa: E402
from node_metrics import node_sums  # noqa: E402

from pd.service.client import NodeClient  # noqa: E402
from pd.service.metrics import time_collections  # noqa: E402
from pd.config import EngineConfig, ModelConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.service.procs import start_node  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402


class Load:
    """The prompts of one phase, and the arrival times of the long ones."""

    def __init__(self, args, vocab: int, mixed: bool, seed: int):
        rng = random.Random(seed)
        self.args = args
        self.streams = [[rng.randrange(vocab) for _ in range(args.stream_prompt)]
                        for _ in range(args.streams)]
        self.longs = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                      for _ in range(args.max_long)] if mixed else []
        self.stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0,
                                            ignore_eos=True)
        self.long_params = SamplingParams(max_tokens=args.long_tokens, temperature=0.0,
                                          ignore_eos=True)

    def due(self, start: float, sent: int) -> bool:
        """Whether the next long prompt is due now."""
        return (sent < len(self.longs)
                and time.perf_counter() >= start + self.args.warmup + sent * self.args.interval)


def gaps(times: dict[str, list[float]], skip: int) -> np.ndarray:
    out = [np.diff(ts[skip:]) for ts in times.values() if len(ts) > skip + 1]
    return np.concatenate(out) * 1e3 if out else np.zeros(1)


def worst(times: dict[str, list[float]], skip: int, start: float) -> str:
    """Where the longest gap of the streams fell: its length, the token it ended at, and when
    (seconds after the phase's `start`), with how many streams had a gap over half of it that
    ended within 1 ms of it (all of them: the stall was the node's or this process's)."""
    found = (0.0, 0, 0.0)
    for ts in times.values():
        d = np.diff(ts[skip:])
        if d.size and d.max() > found[0]:
            i = int(d.argmax())
            found = (float(d[i]), skip + i + 1, ts[skip + i + 1])
    gap, token, at = found
    alike = sum(1 for ts in times.values() for j in range(skip + 1, len(ts))
                if abs(ts[j] - at) < 1e-3 and ts[j] - ts[j - 1] > gap / 2)
    return f"{gap * 1e3:.1f} ms at token {token}, {at - start:.3f} s in, {alike} streams alike"


def run_colocated(engine: Engine, load: Load) -> tuple[np.ndarray, int]:
    reqs = {f"s{i}": engine.add_request(p, load.stream_params, f"s{i}")
            for i, p in enumerate(load.streams)}
    seen = {rid: r.num_tokens for rid, r in reqs.items()}
    times: dict[str, list[float]] = {rid: [] for rid in reqs}
    start, sent = time.perf_counter(), 0
    while engine.has_unfinished():
        while any(not r.is_finished for r in reqs.values()) and load.due(start, sent):
            engine.add_request(load.longs[sent], load.long_params, f"l{sent}")
            sent += 1
        engine.step()
        now = time.perf_counter()
        for rid, r in reqs.items():
            times[rid] += [now] * (r.num_tokens - seen[rid])
            seen[rid] = r.num_tokens
    load.worst = worst(times, load.args.skip, start)
    return gaps(times, load.args.skip), sent


class Arrivals:
    """The arriving prompts, sent and read by a process of their own (spawned once per PD
    setup), so that the process stamping the streams' tokens does nothing else: sending a
    prompt once held its loop 12 ms, seen by every stream as a stall of the decode node.
    `run` starts a phase's arrivals; `finish`, once the streams are done, waits for the last
    and gives (prompts sent, each one's first -> second token gap in ms)."""

    def __init__(self, prefill_addr: str, kv_addr: str) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.streams_done = ctx.Event()
        self.proc = ctx.Process(target=_send_arrivals, daemon=True, args=(
            prefill_addr, kv_addr, self.commands, self.results, self.streams_done))
        self.proc.start()
        assert self.results.get(timeout=120) == "ready"

    def run(self, load: "Load", start: float) -> None:
        self.streams_done.clear()
        self.commands.put((load.longs, load.long_params, start, load.args.warmup,
                           load.args.interval))

    def finish(self) -> tuple[int, np.ndarray]:
        self.streams_done.set()
        sent, joins, error = self.results.get(timeout=600)
        if error:
            raise RuntimeError(error)
        return sent, np.array(joins)

    def close(self) -> None:
        self.commands.put(None)
        self.proc.join(timeout=10)


def _send_arrivals(prefill_addr, kv_addr, commands, results, streams_done) -> None:
    client = NodeClient()
    results.put("ready")
    while (cmd := commands.get()) is not None:
        longs, params, start, warmup, interval = cmd
        sent: list[str] = []
        times: dict[str, list[float]] = {}
        while not (streams_done.is_set() and all(client.results[r].done for r in sent)):
            if (not streams_done.is_set() and len(sent) < len(longs)
                    and time.perf_counter() >= start + warmup + len(sent) * interval):
                sent.append(client.submit(prefill_addr, kv_addr, longs[len(sent)], params))
                times[sent[-1]] = []
            for msg in client.poll(0.001):
                if msg.req_id in times:
                    times[msg.req_id] += [time.perf_counter()] * len(msg.token_ids)
        failed = [client.results[r].error for r in sent if client.results[r].error]
        joins = [(times[r][1] - times[r][0]) * 1e3 for r in sent if len(times[r]) > 1]
        results.put((len(sent), joins, f"{len(failed)} prompt(s) failed: {failed[0]}" if failed
                     else None))
    client.close()


def run_pd(client: NodeClient, prefill, decode, load: Load,
           arrivals: Arrivals) -> tuple[np.ndarray, int, np.ndarray]:
    """The streams' ITL gaps (ms), the prompts sent (by `arrivals`), and each arriving prompt's
    gap from its first token (sent on by the decode node as it arrives, before the KV) to its
    second (its first decode step, once its KV is in): the transfer's exposed time plus one
    step."""
    streams = [client.submit(prefill.addr, decode.kv_addr, p, load.stream_params)
               for p in load.streams]
    times: dict[str, list[float]] = {rid: [] for rid in streams}
    start = last = time.perf_counter()
    if load.longs:
        arrivals.run(load, start)
    longest = (0.0, 0.0)  # this process's longest turn of its loop: (seconds, when)
    while not all(client.results[r].done for r in streams):
        msgs = client.poll(0.001)
        now = time.perf_counter()
        if now - last > longest[0]:
            longest = (now - last, now - start)
        last = now
        for msg in msgs:
            if msg.req_id in times:
                times[msg.req_id] += [now] * len(msg.token_ids)
    sent, joins = arrivals.finish() if load.longs else (0, np.zeros(0))
    failed = [r.error for r in client.results.values() if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    load.worst = (worst(times, load.args.skip, start) + f"; this process's longest turn "
                  f"{longest[0] * 1e3:.1f} ms at {longest[1]:.3f} s")
    return gaps(times, load.args.skip), sent, joins


def exposed(decode) -> np.ndarray:
    """The decode node's pd_kv_exposed_seconds (sum, count) and pd_request_join_seconds (sum,
    count: a handed-over request's first token -> its joining the batch), and its step gaps
    (sum, count, how many of at most 250 us) from its /metrics."""
    got = node_sums(f"127.0.0.1:{decode.info['metrics_port']}")
    return np.array([got.get(f"pd_{name}_seconds_{x}", 0.0) for name in ("kv_exposed", "request_join")
                     for x in ("sum", "count")]
                    + [got.get(f"pd_decode_step_gap_seconds_{x}", 0.0) for x in ("sum", "count")]
                    + [got.get('pd_decode_step_gap_seconds_le="0.00025"', 0.0)])


class Pauses:
    """This process's garbage collections of generations 1 and 2 since made: how many, and the
    longest in ms (each stops the stamping of arriving tokens)."""

    def __init__(self) -> None:
        self.count, self.longest = 0, 0.0
        self.callback = time_collections(self.add)

    def add(self, generation: int, seconds: float) -> None:
        self.count += 1
        self.longest = max(self.longest, seconds * 1e3)

    def close(self) -> None:
        gc.callbacks.remove(self.callback)


def node_gc(node) -> tuple[float, float]:
    """A node's pd_gc_pause_seconds (count, sum) from its /metrics."""
    got = node_sums(f"127.0.0.1:{node.info['metrics_port']}")
    return got.get("pd_gc_pause_seconds_count", 0.0), got.get("pd_gc_pause_seconds_sum", 0.0)


def counter(node, name: str, **labels) -> float:
    """A node's counter `name` (its `_total` line) summed over the children whose labels
    include `labels`, from its /metrics."""
    url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "_total{") and all(w in line for w in want))


def parts_sent(prefill) -> float:
    """The prefill node's KV parts sent while their prompts' prefill still ran."""
    return counter(prefill, "pd_kv_parts_sent")


def slow_steps(decode, top: int = 4) -> str:
    """The decode node's slow-step warnings (PD_LOG_SLOW_STEPS_MS): how many, and the longest
    with where their time went."""
    with open(decode.log_path, errors="replace") as f:
        lines = [line.split("slow step, ", 1)[1].strip() for line in f if "slow step, " in line]
    lines.sort(key=lambda line: -float(line.split(" ms", 1)[0]))
    return f"{len(lines)}" + "".join(f"\n    {line}" for line in lines[:top])


def row(name: str, alone: np.ndarray, mixed: np.ndarray, sent: int) -> str:
    p = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    return (f"{name:>10} | {p(alone, 50):7.2f} {p(alone, 99):7.2f} {alone.max():7.2f} | "
            f"{p(mixed, 50):7.2f} {p(mixed, 99):7.2f} {mixed.max():8.2f} | {sent:5d} | "
            f"{p(mixed, 99) / p(alone, 99):6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: random Llama-3.2-1B shape)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script)")
    ap.add_argument("--prefill-device", default="cuda:0", help="P's device, and the colocated engine's")
    ap.add_argument("--decode-device", default="cuda:1", help="D's device")
    ap.add_argument("--streams", type=int, default=16, help="steady decode streams")
    ap.add_argument("--stream-prompt", type=int, default=128, help="prompt tokens of a stream")
    ap.add_argument("--stream-tokens", type=int, default=512, help="tokens each stream decodes")
    ap.add_argument("--prompt-len", type=int, default=4096, help="tokens of an arriving prompt")
    ap.add_argument("--long-tokens", type=int, default=16, help="tokens an arriving prompt asks for")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between arriving prompts")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds before the first arrives")
    ap.add_argument("--max-long", type=int, default=256, help="at most this many arriving prompts")
    ap.add_argument("--skip", type=int, default=4, help="first tokens of a stream left out of ITL")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prefill chunk per step, for P and the colocated engine")
    ap.add_argument("--setups", nargs="+", default=["pd", "colocated"], choices=["pd", "colocated"])
    ap.add_argument("--transports", nargs="+", default=None, choices=["ipc", "shm", "zmq"],
                    help="the PD setup's KV transports, one row each (default: ipc and shm on "
                         "GPUs, shm on CPU)")
    ap.add_argument("--slow-ms", type=float, default=5.0,
                    help="the decode node logs each step slower than this (PD_LOG_SLOW_STEPS_MS); "
                         "the count and the longest are printed (default: 5)")
    args = ap.parse_args()

    cuda = args.prefill_device.startswith("cuda")
    transports = args.transports or (["ipc", "shm"] if cuda else ["shm"])
    dtype = "bfloat16" if cuda else "float32"
    ctx = args.prompt_len + args.long_tokens + 16
    if args.model:
        model = args.model
    elif args.tiny:
        model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-mixed-"), "llama",
                                          max_position_embeddings=max(ctx, 1024), vocab_size=512))
    else:
        model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-mixed-"), "llama", mtp=False,
                                          dtype="bfloat16", **LLAMA_1B))
    blocks = (args.streams * (args.stream_prompt + args.stream_tokens) + 8 * ctx) // 16 + 64
    common = ["--model", model, "--dtype", dtype, "--num-blocks", str(blocks),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    vocab = ModelConfig.from_dir(model).vocab_size
    print(f"model {model}; {args.streams} streams of {args.stream_tokens} tokens; mixed: "
          f"{args.prompt_len}-token prompts every {args.interval}s")
    results, joins, ready, collections, slow = {}, {}, {}, {}, {}
    for name in transports if "pd" in args.setups else []:
        decode = start_node("decode", [*common, "--device", args.decode_device, "--port", "0",
                                       "--kv-port", "0", "--metrics-port", "0",
                                       # every graph its sequences meet captured before serving
                                       "--cuda-graph-max-tokens",
                                       str(max(ctx, args.stream_prompt + args.stream_tokens))],
                            env={"PD_LOG_SLOW_STEPS_MS": str(args.slow_ms)}, timeout=600,
                            die_with_parent=True)
        prefill = start_node("prefill", [*common, "--device", args.prefill_device, "--port", "0",
                                         "--metrics-port", "0", "--transport", name],
                             timeout=600, die_with_parent=True)
        decode.addr, decode.kv_addr = f"tcp://127.0.0.1:{decode.info['port']}", decode.info["kv_addr"]
        prefill.addr = f"tcp://127.0.0.1:{prefill.info['port']}"
        client = NodeClient()
        arrivals = Arrivals(prefill.addr, decode.kv_addr)
        try:
            run_pd(client, prefill, decode, Load(args, vocab, mixed=True, seed=99),
                   arrivals)  # warm-up
            pauses, gc_before = Pauses(), node_gc(decode)
            load = Load(args, vocab, mixed=False, seed=1)
            alone, _, _ = run_pd(client, prefill, decode, load, arrivals)
            worst_alone = load.worst
            before, parts = exposed(decode), parts_sent(prefill)
            load = Load(args, vocab, mixed=True, seed=2)
            mixed, sent, joins[name] = run_pd(client, prefill, decode, load, arrivals)
            d = exposed(decode) - before
            ready[name] = dict(exposed=d[0] / max(d[1], 1), count=d[1],
                               parts=parts_sent(prefill) - parts, join=d[2] / max(d[3], 1),
                               gap=d[4] / max(d[5], 1), long_gaps=d[5] - d[6],
                               worst_alone=worst_alone, worst_mixed=load.worst)
            gc_after = node_gc(decode)
            pauses.close()
            collections[name] = (gc_after[0] - gc_before[0],
                                 (gc_after[1] - gc_before[1]) * 1e3, pauses)
            results[f"PD {name}"] = (alone, mixed, sent)
            slow[name] = slow_steps(decode)
        finally:
            arrivals.close()
            client.close()
            prefill.stop()
            decode.stop()
    if "colocated" in args.setups:
        engine = Engine(EngineConfig(model=model, device=args.prefill_device, dtype=dtype,
                                     num_blocks=blocks,
                                     max_num_batched_tokens=args.max_num_batched_tokens))
        run_colocated(engine, Load(args, vocab, mixed=True, seed=99))  # warm-up
        alone, _ = run_colocated(engine, Load(args, vocab, mixed=False, seed=1))
        mixed, sent = run_colocated(engine, Load(args, vocab, mixed=True, seed=2))
        results["colocated"] = (alone, mixed, sent)
    print(f"\ndecode ITL of the steady streams, ms   (P on {args.prefill_device}, D on "
          f"{args.decode_device}; colocated on {args.prefill_device})")
    print(f"{'setup':>10} | {'streams alone':>23} | {'with arriving prompts':>24} | {'sent':>5} | "
          f"p99 mixed/alone")
    print(f"{'':>10} | {'p50':>7} {'p99':>7} {'max':>7} | {'p50':>7} {'p99':>7} {'max':>8} |       |")
    for name, (alone, mixed, sent) in results.items():
        print(row(name, alone, mixed, sent))
    for name, ms in joins.items():
        if ms.size:
            r = ready[name]
            print(f"PD {name}: an arriving prompt's first -> second token (its KV's way in "
                  f"+ one step), ms: p50 {np.percentile(ms, 50):.2f}, max {ms.max():.2f}; the "
                  f"decode node's first token in -> joined (pd_request_join_seconds) mean "
                  f"{r['join'] * 1e3:.2f} ms, KV in -> first decoded token "
                  f"(pd_kv_exposed_seconds) mean {r['exposed'] * 1e3:.2f} ms over "
                  f"{r['count']:.0f} requests; {r['parts']:.0f} KV parts sent during prefills; "
                  f"the device's step gaps with prompts: mean {r['gap'] * 1e6:.0f} us, "
                  f"{r['long_gaps']:.0f} over 250 us; the streams' longest gap alone: "
                  f"{r['worst_alone']}; with prompts: {r['worst_mixed']}")
    for name, (count, ms, pauses) in collections.items():
        print(f"PD {name}: garbage collections (generations 1-2) over both phases: the "
              f"decode node {count:.0f}, {ms:.1f} ms in all; this process (which stamps the "
              f"tokens) {pauses.count}, the longest {pauses.longest:.1f} ms")
    for name, text in slow.items():
        print(f"PD {name}: the decode node's steps over {args.slow_ms:g} ms (warm-up included), "
              f"by phase in ms: {text}")


if __name__ == "__main__":
    main()
