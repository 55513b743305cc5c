"""Tensor parallelism inside one engine (`pd.engine.tp`, 2 gloo ranks on the CPU): greedy and
seeded sampled tokens equal one rank's, token for token, for the three architectures written by
transformers (tied embeddings with a vocabulary that does not split evenly, q/k/v biases, q/k
norms), with MTP, and with a grammar in the overlap loop; the forward context crosses to the
workers whole; a graph with model calls has a twin on the workers, one without none; the weight
slices are the checkpoint's; a size that does not split the model is refused before any rank
starts."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from pd.config import ModelConfig
from pd.engine.llm import LLM
from pd.engine.tp import Mirror
from pd.engine.tp.channel import context_of, context_parts
from pd.model import parallel
from pd.model.context import host_context
from pd.model.loader import shard
from pd.testing.hf import write_hf_checkpoint
from pd.wire.geometry import mismatch
from pd.wire.sampling_params import SamplingParams

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 3], [7], list(range(100, 140))]
ARCHS = {
    "llama-tied-odd-vocab": dict(arch="llama", tie_word_embeddings=True, vocab_size=509),
    "qwen2-bias": dict(arch="qwen2", attention_bias=True),
    "qwen3": dict(arch="qwen3", num_layers=3),
}


def generate(model_dir, params, **kw) -> list:
    with LLM(model_dir, num_blocks=64, **kw) as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("name", list(ARCHS))
def test_two_ranks_equal_one(tmp_path, name):
    model_dir = write_hf_checkpoint(tmp_path / name, **ARCHS[name])
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    one = generate(model_dir, [greedy, greedy, sampled])
    two = generate(model_dir, [greedy, greedy, sampled], tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert b.token_ids == a.token_ids
        assert len(set(a.token_ids)) > 2, "degenerate reference: the test would prove little"
    for a, b in zip(one[:2], two[:2]):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in b.top_logprobs] == \
            [[t for t, _ in top] for top in a.top_logprobs]
    assert parallel.group().size == 1  # closing the engine leaves this process one rank again


def test_two_ranks_with_mtp_equal_plain_greedy():
    # the embedded model: its MTP layer is trained, so drafts are accepted
    prompts = ["def fib(n):", "import numpy as np\n", "class Stack:\n    def push"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(num_blocks=64) as llm:
        plain = llm.generate(prompts, params)
    with LLM(num_blocks=64, tensor_parallel_size=2, num_speculative_tokens=2) as llm:
        mtp = llm.generate(prompts, params)
        assert llm.engine.spec.stats.num_accepted_tokens > 10
    assert [o.token_ids for o in mtp] == [o.token_ids for o in plain]


def test_two_ranks_with_a_grammar_and_overlap_equal_one():
    # the overlap loop's thread and the deferred sampler's masks, with plain and MTP steps
    prompts = ["def fib(n):", "import numpy as np\n", "class Foo:"]
    params = SamplingParams(max_tokens=16, temperature=0.0,
                            structured_output=("regex", "[a-z_]+\\(\\d+\\)"))
    with LLM(num_blocks=64) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    for k in (0, 2):
        with LLM(num_blocks=64, tensor_parallel_size=2, overlap=True,
                 num_speculative_tokens=k) as llm:
            assert [o.token_ids for o in llm.generate(prompts, params)] == ref


def test_a_rank_holds_its_slice(monkeypatch):
    torch.manual_seed(0)
    q, o, embed = torch.randn(8, 6), torch.randn(6, 8), torch.randn(5, 3)
    monkeypatch.setattr(parallel, "_GROUP", parallel.Group(1, 2))
    assert torch.equal(shard("model.layers.0.self_attn.q_proj.weight", q), q[4:])
    assert torch.equal(shard("model.layers.0.self_attn.q_proj.bias", q[:, 0]), q[4:, 0])
    assert torch.equal(shard("model.layers.0.self_attn.o_proj.weight", o), o[:, 4:])
    assert torch.equal(shard("model.layers.0.self_attn.o_proj.bias", q[:, 0]), q[:, 0])
    assert torch.equal(shard("model.layers.0.input_layernorm.weight", q[:, 0]), q[:, 0])
    # 5 vocabulary rows over 2 ranks: 3 each, the last rank's padded with a zero row
    part = shard("model.embed_tokens.weight", embed)
    assert part.shape == (3, 3) and torch.equal(part[:2], embed[3:]) and not part[2].any()


def test_the_forward_context_crosses_to_the_workers_whole():
    # what a worker rebuilds from a call's header and tensors is the context rank 0 ran with,
    # field by field (a prefill chunk after cached KV beside a decode row: every kind of field)
    ctx = host_context([3, 1], [7, 5], [[4, 9], [2]], [147, 148, 149, 36], block=4)
    ctx.mask()  # a tensor made on first use travels too
    scalars, tensors = context_parts(ctx)
    header = msgpack.unpackb(msgpack.packb(scalars))
    back = context_of(header, [t.clone() for t in tensors])
    for f in dataclasses.fields(ctx):
        a, b = getattr(ctx, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype, f.name
        else:
            assert a == b and type(a) is type(b), f.name
    assert context_parts(None) == (None, []) and context_of(None, []) is None


class Recorder:
    """The channel's two sends, recorded (a unit test of the mirror alone)."""

    def __init__(self):
        self.sent = []

    def send(self, header, tensors):
        self.sent.append(header["op"])

    def send_replay(self, key):
        self.sent.append(f"replay {key}")


class FakeGraph:
    def reset(self):
        pass


def test_a_graph_with_calls_has_a_twin_and_one_without_none():
    mirror = Mirror(Recorder())
    key = mirror.begin_capture()
    with mirror.mirrored("forward", torch.zeros(2, dtype=torch.int64)):
        pass
    with mirror.mirrored("head_logits", torch.zeros(2, 4)):
        pass
    assert mirror.end_capture(key, FakeGraph()) == key
    empty = mirror.begin_capture()
    assert mirror.end_capture(empty, FakeGraph()) is None  # nothing told: no twin to replay
    mirror.replay(key)
    assert mirror.channel.sent == ["capture_begin", "forward", "head_logits", "capture_end",
                                   f"replay {key}"]
    assert mirror.lock.acquire(blocking=False)  # every capture gave the lock back


def test_a_size_that_does_not_split_the_model_is_refused(tmp_path):
    model_dir = write_hf_checkpoint(tmp_path / "m", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"does not divide the model's num_key_value_heads \(2\)"):
        parallel.check_layout(ModelConfig.from_dir(model_dir), 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM(model_dir, num_blocks=16, tensor_parallel_size=4)
    assert parallel.group().size == 1


def test_the_handshake_names_a_peer_layout_that_cannot_be():
    ours = {"num_kv_heads": 2, "tensor_parallel_size": 1}
    assert mismatch(ours, {"num_kv_heads": 2, "tensor_parallel_size": 2}) is None
    why = mismatch(ours, {"num_kv_heads": 2, "tensor_parallel_size": 4})
    assert "tensor_parallel_size 4" in why and "2 KV heads" in why
