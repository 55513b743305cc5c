"""Prefix caching, measured through `pd launch` (router + real nodes), side by side in one run.

1. shared prefix: every prompt is one system prompt of --prefix-len tokens and a question of
   --input-len; `pd bench` with caching off, then on: TTFT p50/p99 and output tokens/s.
2. multi-turn: --conversations conversations of --turns turns (each turn: the conversation so
   far and a new message), turn by turn, caching off then on: per turn the prompt tokens, the
   KV bytes the prefill node sent, and what the blocks of the new tokens alone would be.
3. routing: 2 prefill nodes with room for half the --routing-prefixes system prompts and one
   more each,
   `pd bench` with --policy load, then cache_aware: prefix-cache hit rate of the prefill nodes
   and each node's share of the prompts.

    python benchmarks/bench_prefix_cache.py                 # CPU, the embedded model
    python benchmarks/bench_prefix_cache.py --device cuda --synthetic-1b --prefix-len 2048 \
        --input-len 128 --output-len 16       # a random Llama-3.2-1B-shaped checkpoint
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pd.cli import bench as pd_bench  # noqa: E402
from pd.cli.bench_run import new_message  # noqa: E402
from pd.config import default_model_dir  # noqa: E402
from pd.service.client import NodeClient  # noqa: E402
from pd.service.procs import Launch  # noqa: E402
from pd.text.tokenizer import Tokenizer  # noqa: E402

BS = 16


def launch(args, *extra: str) -> Launch:
    # NOTE: a node's first long prompts capture prefill CUDA graphs (seconds with no heartbeat
    # answered), which the router's default 3 s on CUDA would take for a dead node
    # --insecure: the benchmark reads the nodes' counters over their (then plain) sockets
    flags = ["--device", args.device, "--num-blocks", str(args.num_blocks),
             "--heartbeat-timeout", "60", "--insecure", *extra]
    return Launch(args.model, *flags, timeout=300)


def node_stats(client: NodeClient, lau: Launch, role: str) -> list[dict]:
    return [client.ping("tcp://" + n["control"]).stats for name, n in sorted(lau.nodes.items())
            if name.startswith(role)]


def mean_seconds(lau: Launch, role: str, name: str) -> float:
    """The mean of a histogram (`name`_sum / `name`_count) over the nodes of `role` (or the
    router), in ms."""
    urls = [f"http://{n['metrics']}/metrics" for node_name, n in lau.nodes.items()
            if node_name.startswith(role) and n["metrics"]]
    total = count = 0.0
    for url in urls if role != "router" else [lau.url + "/metrics"]:
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(name + "_sum{"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(name + "_count{"):
                count += float(line.rsplit(" ", 1)[1])
    return 1000 * total / max(count, 1.0)


def run_bench(lau: Launch, args, *flags: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        p = argparse.ArgumentParser()
        pd_bench.add_arguments(p)
        a = p.parse_args(["--base-url", lau.url, "--tokenizer", args.model, "--ignore-eos",
                          "--disable-progress", "--result-json", f.name, *flags])
        table = io.StringIO()
        with contextlib.redirect_stdout(table):  # its own table: the figures below say it
            if pd_bench.main(a) != 0:
                raise RuntimeError("pd bench failed:\n" + table.getvalue())
        return json.load(open(f.name))


def shared_prefix(args) -> None:
    print(f"\n## 1. shared prefix: {args.num_prompts} prompts, system prompt {args.prefix_len} "
          f"+ question {args.input_len} tokens, {args.output_len} out, concurrency "
          f"{args.concurrency}, {args.device}")
    rows = {}
    for caching in ("off", "on"):
        lau = launch(args, *(() if caching == "on" else ("--no-enable-prefix-caching",)))
        try:
            r = run_bench(lau, args, "--num-prompts", str(args.num_prompts),
                          "--random-prefix-len", str(args.prefix_len),
                          "--random-input-len", str(args.input_len),
                          "--random-output-len", str(args.output_len),
                          "--max-concurrency", str(args.concurrency), "--seed", "1")
            with NodeClient() as client:
                p = node_stats(client, lau, "prefill")[0]
            where = [mean_seconds(lau, "router", "pd_time_to_first_token_seconds"),
                     mean_seconds(lau, "prefill", "pd_first_token_send_seconds"),
                     mean_seconds(lau, "prefill", "pd_step_duration_seconds"),
                     mean_seconds(lau, "decode", "pd_step_duration_seconds")]
        finally:
            lau.stop()
        rows[caching] = (r["median_ttft_ms"], r["p99_ttft_ms"], r["output_throughput"],
                         p["prefix_cache_hits"] / max(1, p["prefix_cache_queries"]), *where)
    print(f"{'caching':<8}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'out tok/s':>11}{'P hit rate':>11}"
          f"{'router TTFT':>12}{'P 1st tok':>10}{'P step':>8}{'D step':>8}")
    for k, (p50, p99, tps, hit, router, first, pstep, dstep) in rows.items():
        print(f"{k:<8}{p50:>12.1f}{p99:>12.1f}{tps:>11.1f}{hit:>11.2f}{router:>12.1f}{first:>10.1f}"
              f"{pstep:>8.1f}{dstep:>8.1f}")
    print("(TTFT: the client's, to its first streamed text; then means in ms: the router's TTFT, "
          "from a request's arrival at the prefill node to its first token sent, step wall times)")
    print(f"TTFT p50 off/on: {rows['off'][0] / rows['on'][0]:.1f}x; output tok/s on/off: "
          f"{rows['on'][2] / rows['off'][2]:.2f}x")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:300]!r}") from None


def multi_turn(args) -> None:
    print(f"\n## 2. multi-turn: {args.conversations} conversations x {args.turns} turns, "
          f"first message {args.first_turn_len}, {args.input_len} new and {args.output_len} out per "
          f"turn, turn by turn, {args.device}")
    tok = Tokenizer.from_dir(args.model)
    per_turn = {}
    for caching in ("off", "on"):
        lau = launch(args, *(() if caching == "on" else ("--no-enable-prefix-caching",)))
        rng = np.random.default_rng(3)
        texts = [new_message(tok, rng, args.first_turn_len) for _ in range(args.conversations)]
        rows = []
        try:
            with NodeClient() as client, ThreadPoolExecutor(args.conversations) as pool:
                prev_tokens = [0] * args.conversations
                for turn in range(args.turns):
                    sent0 = node_stats(client, lau, "prefill")[0]["kv_sent_bytes"]
                    outs = list(pool.map(lambda t: post(lau.url + "/v1/completions", {
                        "model": lau.served_model_name, "prompt": t, "max_tokens": args.output_len,
                        "temperature": 0, "ignore_eos": True}), texts))
                    time.sleep(0.5)  # the last KV acks
                    sent = node_stats(client, lau, "prefill")[0]["kv_sent_bytes"] - sent0
                    ptoks = [o["usage"]["prompt_tokens"] for o in outs]
                    # blocks holding tokens the decode node has not seen (its cache has the
                    # previous turn's prompt and output, all but the newest token's KV)
                    new_blocks = sum(-(-p // BS) - min((q - 1) // BS, p // BS) if q else -(-p // BS)
                                     for p, q in zip(ptoks, prev_tokens))
                    all_blocks = sum(-(-p // BS) for p in ptoks)
                    rows.append((sum(ptoks), sent, all_blocks, new_blocks))
                    prev_tokens = [p + o["usage"]["completion_tokens"] for p, o in zip(ptoks, outs)]
                    texts = [t + o["choices"][0]["text"] + new_message(tok, rng, args.input_len)
                             for t, o in zip(texts, outs)]
        finally:
            lau.stop()
        per_turn[caching] = rows
    block_bytes = per_turn["off"][0][1] / per_turn["off"][0][2]
    print(f"{'turn':<5}{'prompt tok':>11}{'KV sent off':>13}{'KV sent on':>12}{'whole prompt':>14}"
          f"{'new blocks':>12}{'on/new':>8}")
    for t, (off, on) in enumerate(zip(per_turn["off"], per_turn["on"])):
        print(f"{t + 1:<5}{on[0]:>11}{off[1] / 2**20:>11.2f}Mi{on[1] / 2**20:>10.2f}Mi"
              f"{on[2] * block_bytes / 2**20:>12.2f}Mi{on[3] * block_bytes / 2**20:>10.2f}Mi"
              f"{on[1] / max(1.0, on[3] * block_bytes):>8.2f}")


def routing(args) -> None:
    n = args.routing_prefixes
    blocks = (args.routing_prefix_len + args.routing_input_len) // BS + 1
    room = blocks * (n // 2 + 1)  # half the system prompts, and one more for those in flight
    print(f"\n## 3. routing: 2 prefill nodes of {room} blocks, {n} system prompts of "
          f"{args.routing_prefix_len} tokens + {args.routing_input_len}, {args.routing_prompts} "
          f"prompts, concurrency "
          f"{args.concurrency}, {args.device}")
    print(f"{'policy':<12}{'hit rate':>9}{'per node':>16}{'prompts/node':>16}{'max/min':>9}")
    for policy in ("load", "cache_aware"):
        lau = launch(args, "--num-prefill", "2", "--prefill-num-blocks", str(room),
                     "--policy", policy)
        try:
            run_bench(lau, args, "--num-prompts", str(args.routing_prompts),
                      "--random-prefix-len", str(args.routing_prefix_len),
                      "--random-num-prefixes", str(n), "--random-input-len", str(args.routing_input_len),
                      "--random-output-len", "4", "--max-concurrency", str(args.concurrency),
                      "--seed", "2", "--no-test-request")
            with NodeClient() as client:
                ps = node_stats(client, lau, "prefill")
        finally:
            lau.stop()
        q = [p["prefix_cache_queries"] for p in ps]
        h = [p["prefix_cache_hits"] for p in ps]
        per = "/".join(f"{hi / max(1, qi):.2f}" for hi, qi in zip(h, q))
        share = "/".join(str(round(qi / (args.routing_prefix_len + args.routing_input_len)))
                         for qi in q)
        print(f"{policy:<12}{sum(h) / max(1, sum(q)):>9.2f}{per:>16}{share:>16}"
              f"{max(q) / max(1, min(q)):>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--first-turn-len", type=int, default=256)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--routing-prefixes", type=int, default=8)
    p.add_argument("--routing-prefix-len", type=int, default=512)
    p.add_argument("--routing-input-len", type=int, default=16)
    p.add_argument("--routing-prompts", type=int, default=160)
    p.add_argument("--parts", default="1,2,3")
    p.add_argument("--synthetic-1b", action="store_true",
                   help="a random bf16 Llama-3.2-1B-shaped checkpoint (with the tiny tokenizer's "
                        "512-token vocabulary) instead of --model")
    args = p.parse_args()
    if args.synthetic_1b:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
        from bench_decode import LLAMA_1B

        from pd.testing.tiny import write_tiny_checkpoint

        # NOTE: the tiny tokenizer's 512 ids, not 128k: a token past them decodes to no text,
        # and a client sees its first token only with the first visible text
        args.model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-prefix-"), "llama",
                                               mtp=False, dtype="bfloat16",
                                               **{**LLAMA_1B, "vocab_size": 512}))
    parts = {"1": shared_prefix, "2": multi_turn, "3": routing}
    for k in args.parts.split(","):
        parts[k](args)


if __name__ == "__main__":
    main()
