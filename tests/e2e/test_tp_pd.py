"""Tensor parallelism across the PD path with real processes: a prefill node and a decode node
with different tensor parallel sizes (2 ranks, gloo on CPU) give the tokens of single-process
generation through the ring and ZMQ (with MTP on both nodes too; again with the decode node's
prefix cache holding part of each prompt), and a node whose worker rank dies goes down and says why.
With PD_TEST_DEVICE=cuda on a host with two GPUs, the ranks are cuda:0 and cuda:1 (NCCL)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams
from tests.e2e.conftest import DEVICE, DEVICE_KWARGS, wait_idle
from tests.e2e.test_pd_path import mixed_prompts

pytestmark = pytest.mark.skipif(
    DEVICE != "cpu" and torch.cuda.device_count() < 2,
    reason="two ranks on CUDA need two GPUs (PD_TEST_DEVICE=cuda on a two-GPU host)")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=512, **DEVICE_KWARGS)


def worker_pids(node) -> list[int]:
    """The node's worker ranks, from its log line `tensor parallel: N ranks (workers ...)`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"tensor parallel: \d+ ranks \(workers ([\d, ]+)\)",
                          Path(node.log_path).read_text())
        if found:
            return [int(p) for p in found.group(1).split(",")]
        time.sleep(0.1)
    raise AssertionError("the node never logged its worker ranks")


@pytest.mark.parametrize("prefill_tp,decode_tp,transport,mtp", [
    (2, 1, "shm", 0), (1, 2, "shm", 0), (2, 2, "zmq", 2)])
def test_different_tp_sizes_equal_single_process(cluster, client, reference, prefill_tp,
                                                 decode_tp, transport, mtp):
    spec = ["--num-speculative-tokens", str(mtp)]  # greedy MTP gives plain greedy's tokens
    decode, prefill = cluster.ready(
        cluster.decode("--tensor-parallel-size", str(decode_tp), *spec, wait=False),
        cluster.prefill("--tensor-parallel-size", str(prefill_tp), "--transport", transport,
                        *spec, wait=False))
    prompts = mixed_prompts(12, seed=prefill_tp * 10 + decode_tp)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=k)
              for k in (None, 2) * 6]
    expected = reference.generate(prompts, params)
    # the second round finds the prompts' blocks in the decode node's prefix cache: the prefill
    # node sends (joins, splits) only the rest
    for _ in range(2):
        ids = [client.submit(prefill.addr, decode.kv_addr, p, sp)
               for p, sp in zip(prompts, params)]
        for res, ref, sp in zip(client.wait(ids, timeout=120), expected, params):
            assert res.error is None
            assert res.token_ids == ref.token_ids
            if sp.logprobs is not None:
                assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert client.ping(decode.addr).stats["prefix_cache_hits"] > 0
    for node, size in ((prefill, prefill_tp), (decode, decode_tp)):
        stats = wait_idle(client, node)
        assert stats["free_blocks"] == stats["total_blocks"]
        assert (f"tensor parallel: {size} ranks" in Path(node.log_path).read_text()) == (size > 1)
    assert f"KV over {transport}" in Path(prefill.log_path).read_text()
    for node in (prefill, decode):
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=60) == 0


def test_a_dead_rank_takes_its_node_down(cluster):
    decode = cluster.decode("--tensor-parallel-size", "2")
    (worker,) = worker_pids(decode)
    os.kill(worker, signal.SIGKILL)
    assert decode.proc.wait(timeout=30) == 70
    log = Path(decode.log_path).read_text()
    assert f"tensor parallel rank 1 (pid {worker}) ended with exit code -9" in log


def test_a_size_that_does_not_split_the_heads_is_refused(cluster):
    # the tiny model has 2 KV heads: 4 ranks cannot each hold a whole share
    node = cluster.decode("--tensor-parallel-size", "4", wait=False)
    assert node.proc.wait(timeout=60) != 0
    log = Path(node.log_path).read_text()
    assert "tensor parallel size 4 does not divide the model's num_key_value_heads (2)" in log
    assert "tensor parallel: " not in log  # refused before any worker started
