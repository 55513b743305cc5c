"""TTFT through prefill + decode nodes vs single-process prefill, for one long prompt on CPU.

Prints one table: single-process prefill time (one engine step over the prompt), TTFT when the
prefill node answers the client itself (max_tokens 1: P -> client), TTFT through the decode node
(P -> D -> client, what every streamed request sees), and the difference, which is the cost of
the FIRST_TOKEN hop through the decode node. Real processes on loopback, the KV transport as
chosen by --transport.

    python benchmarks/bench_ttft.py --prompt-len 1000 --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pd.service.client import NodeClient
from pd.engine.llm import LLM
from pd.service.procs import start_node
from pd.wire.sampling_params import SamplingParams
from pd.testing.tiny import write_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: a tiny random model, hidden 256, 4 layers)")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "zmq"])
    args = ap.parse_args()
    model = args.model or str(write_tiny_checkpoint(
        tempfile.mkdtemp(prefix="pd-bench-"), hidden_size=256, intermediate_size=768,
        num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=4096))
    prompt = [3 + (i * 7919) % 500 for i in range(args.prompt_len)]

    llm = LLM(model, num_blocks=512)
    engine = llm.engine
    single = []
    for _ in range(args.repeats + 1):
        t = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        engine.step()
        single.append(time.perf_counter() - t)
    single = single[1:]

    common = ["--model", model, "--port", "0", "--num-blocks", "512", "--log-level", "warning"]
    d = start_node("decode", [*common, "--kv-port", "0"])
    p = start_node("prefill", [*common, "--transport", args.transport])
    client = NodeClient()
    paddr = f"tcp://127.0.0.1:{p.info['port']}"
    try:
        def ttft(max_tokens: int) -> list[float]:
            out = []
            for _ in range(args.repeats + 1):
                rid = client.submit(paddr, d.info["kv_addr"], prompt,
                                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                r = client.wait([rid], timeout=60)[0]
                assert r.error is None, r.error
                out.append(r.first_token_time - r.sent_time)
            return out[1:]

        direct = ttft(1)
        through_d = ttft(2)
    finally:
        client.close()
        p.stop()
        d.stop()
    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"prompt {args.prompt_len} tokens, {args.repeats} runs each, medians in ms "
          f"(transport {args.transport})")
    print(f"| single-process prefill | TTFT P->client | TTFT P->D->client | FIRST_TOKEN hop via D |")
    print(f"|---|---|---|---|")
    print(f"| {med(single):.2f} | {med(direct):.2f} | {med(through_d):.2f} | "
          f"{med(through_d) - med(direct):.2f} |")


if __name__ == "__main__":
    main()
