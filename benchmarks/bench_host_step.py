"""The host's per-request work in a decode step, and a long prompt's, timed alone (no model, no
device): what a decode node's Python does per step at a batch size, which on a GPU must fit in
the device's step. Medians of repeated calls, in microseconds.

- graph inputs: a graphed decode step's inputs in its layout filled whole
  (`fill_decode_inputs`), and advanced from the step before's for the same requests
  (`DecodeInputs`, a steady batch's step);
- sampler rows: a step's `SamplingRow`s (`ModelRunner.sampling_row`);
- append + stop: each request's token appended and its stop checked (`DecodeLoop.process`);
- register: a prompt's full blocks entered in the prefix cache after its step
  (`BlockAllocator.register_all`, at --prompt tokens);
- prompt slots: a prompt chunk's KV slots (`run_slots`);
- with `--walks N`: N JSON grammars over a 128,256-token vocabulary each walking one token, as
  a step's checked rows do (`pd.engine.grammar.step_masks`: one `accept_token` each), beside
  the same walks through xgrammar's batch call on one thread (the tokenizer is trained first,
  ~40 s).

    python benchmarks/bench_host_step.py [--batch 64 256] [--prompt 8192] [--walks 32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pd.engine.allocator import BlockAllocator  # noqa: E402
from pd.engine.decode_inputs import DecodeInputs, DecodeLayout, fill_decode_inputs  # noqa: E402
from pd.engine.prefix import chain_hashes  # noqa: E402
from pd.engine.request import Req, ReqStatus  # noqa: E402
from pd.engine.runner import ModelRunner  # noqa: E402
from pd.model.context import run_slots  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16


def median_us(fn, repeat: int = 300, after=None) -> float:
    """Median us of `fn` over `repeat` calls after one warm-up, each call followed by `after`
    (not timed) where given."""
    times = []
    for i in range(repeat + 1):
        t = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t)
        if after is not None:
            after()
    return statistics.median(times) * 1e6


def running(batch: int, context: int) -> list[Req]:
    """`batch` decoding requests of 16-token prompts, `context` tokens each so far."""
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(batch):
        req = Req(str(i), list(range(3, 19)), params)
        req.token_ids += list(range(100, 100 + context - 16))
        req.num_computed_tokens = req.num_tokens - 1
        req.block_ids = list(range(i * 64, i * 64 + -(-context // BLOCK)))
        req.status = ReqStatus.RUNNING
        reqs.append(req)
    return reqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=144, help="tokens per decoding request")
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens for register and slots")
    p.add_argument("--walks", type=int, default=0,
                   help="also time this many JSON grammars' walks of one token each (0: not)")
    args = p.parse_args()
    print(f"{'batch':>5} | {'graph inputs':>12} {'advanced':>8} {'sampler rows':>12} "
          f"{'append + stop':>13} (us)")
    for batch in args.batch:
        reqs = running(batch, args.context)
        width = 1 << (max(len(r.block_ids) for r in reqs) - 1).bit_length()
        layout = DecodeLayout(batch, width)
        flat = np.zeros(layout.size, dtype=np.int64)
        inputs = DecodeInputs(BLOCK, 0)
        inputs.fill(flat, layout, reqs)  # the steps timed next advance this one

        def append_and_stop() -> None:
            for req in reqs:
                req.append_token(5)
                req.check_stop(1 << 20)
            for req in reqs:
                req.token_ids.pop()

        print(f"{batch:>5} | {median_us(lambda: fill_decode_inputs(flat, layout, reqs, BLOCK, 0)):>12.1f} "
              f"{median_us(lambda: inputs.fill(flat, layout, reqs)):>8.1f} "
              f"{median_us(lambda: [ModelRunner.sampling_row(r, mask=False) for r in reqs]):>12.1f} "
              f"{median_us(append_and_stop):>13.1f}")
    rng = random.Random(0)
    tokens = [rng.randrange(32000) for _ in range(args.prompt)]
    hashes = chain_hashes(tokens, BLOCK, 12345)
    blocks_needed = len(hashes)

    def register() -> None:
        allocator = BlockAllocator(blocks_needed + 1, caching=True)
        allocator.register_all(allocator.allocate(blocks_needed), hashes)

    alloc_only = median_us(lambda: BlockAllocator(blocks_needed + 1, caching=True).allocate(blocks_needed), 50)
    table = list(range(blocks_needed))
    print(f"prompt of {args.prompt} tokens: register {median_us(register, 50) - alloc_only:.1f} us "
          f"({blocks_needed} blocks), KV slots {median_us(lambda: run_slots(table, 0, args.prompt, BLOCK)):.1f} us")
    if args.walks:
        walks(args.walks)


def walks(num: int) -> None:
    """`num` JSON grammars (`bench_structured.py`'s schema), each at another point of one JSON
    text, walking its next token: as `step_masks` walks them, and as one xgrammar batch call on
    one thread, in turn."""
    import tempfile  # noqa: PLC0415 (the rows above need neither)

    import xgrammar
    from tokenizers import Tokenizer

    from bench_structured import SPECS

    from pd.engine.grammar import Grammars, step_masks
    from pd.testing.tiny import write_tiny_checkpoint

    vocab = 128256
    model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-walks-"), "llama", mtp=False,
                                  vocab_size=vocab, full_vocab=True)
    text = '{"name": "alpha beta gamma delta", "tags": ["one", "two", "three"], "size": 12345}'
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    grammars = Grammars(model, vocab, (1,))
    states = [grammars.matcher(SPECS["json"], checked=True) for _ in range(num)]
    nexts = []
    for i, state in enumerate(states):
        at = i % (len(ids) - 1)
        for token in ids[:at]:
            assert state.accept(token)
        nexts.append(ids[at])
    batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def ours() -> None:
        step_masks([(state, token, None) for state, token in zip(states, nexts)], None)

    def batched() -> None:  # as `step_masks` walked them before: one batch call
        alive = [not state.terminated for state in states]
        made = [(state._m, token) for state, token, a in zip(states, nexts, alive) if a]
        oks = iter(batch.batch_accept_token([m for m, _ in made], [t for _, t in made]))
        for state, token, a in zip(states, nexts, alive):
            state.walked(token, next(oks) if a else None)

    def unwalk() -> None:
        for state in states:
            state._unwalk([])

    for _ in range(2):  # in turn, twice
        print(f"{num} JSON grammars' walks ({vocab} tokens): step_masks "
              f"{median_us(ours, after=unwalk):.1f} us, through xgrammar's batch call "
              f"{median_us(batched, after=unwalk):.1f} us")


if __name__ == "__main__":
    main()
