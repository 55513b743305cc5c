"""A transformers-written checkpoint with what real ones carry, served by `pd launch`: a
vocabulary padded past the tokenizer's (ids that decode as empty text), a sentencepiece-style
(Metaspace) tokenizer, and sampling defaults in generation_config.json."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pd.engine.llm import LLM
from pd.service.procs import Launch
from pd.wire.sampling_params import SamplingParams
from pd.testing.hf import write_hf_checkpoint
from pd.testing.tiny import SPECIAL_TOKENS

transformers = pytest.importorskip("transformers")
PROMPTS = ["def fibonacci(n):", "import os", "class Stack:"]


def metaspace_tokenizer() -> Tokenizer:
    """A BPE over '▁'-joined words, as sentencepiece models (Llama 2, Mistral) are converted."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    text = Path(importlib.util.find_spec("string").origin).read_text()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = metaspace_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("metaspace-padded"), "qwen2", tokenizer=tok, vocab_size=vocab + 128,
        max_position_embeddings=10240 + 64, tie_word_embeddings=True,
        generation={"do_sample": True, "top_k": 1, "temperature": 0.7})


@pytest.fixture(scope="module")
def server(model_dir):
    launch = Launch(model_dir, "--num-blocks", "1024", "--max-num-seqs", "8")
    yield launch
    assert launch.stop() == 0


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(model_dir, num_blocks=256)


def test_the_checkpoint_is_what_the_test_claims(model_dir, reference):
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert reference.engine.model_config.vocab_size == hf_tok.vocab_size + 128 == \
        len(hf_tok) + 128
    ids = reference.tokenizer.encode("return self.value")
    assert sum(reference.tokenizer.id_to_token(i).startswith("▁") for i in ids) >= 2


def test_one_detokenizer_for_the_router_and_pd_llm(api, server, reference, model_dir):
    """Greedy text through the router equals pd.LLM's, and both equal the tokenizer's decoding
    of prompt + output minus the prompt's: the first output token keeps its leading space."""
    hf_tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spaced = 0
    for prompt, out in zip(PROMPTS, reference.generate(PROMPTS, params)):
        got = api.completions.create(model=server.served_model_name, prompt=prompt, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
        ids = reference.tokenizer.encode(prompt)
        want = hf_tok.decode(ids + out.token_ids, skip_special_tokens=True)[
            len(hf_tok.decode(ids, skip_special_tokens=True)):]
        assert got.choices[0].text == out.text == want
        spaced += out.text.startswith(" ")
    assert spaced, "no output started with a space: the case this test is about never came up"


def test_generation_config_defaults_apply_to_requests_that_omit_them(api, server, reference):
    """generation_config.json says top_k=1: a request that omits top_k samples greedily, one that
    turns it off does not."""
    greedy = reference.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0,
                                                        ignore_eos=True))
    omitted, explicit = [], []
    for prompt in PROMPTS:
        kw = dict(model=server.served_model_name, prompt=prompt, max_tokens=16, seed=5)
        omitted.append(api.completions.create(**kw, extra_body={"ignore_eos": True}))
        explicit.append(api.completions.create(**kw, temperature=1.0,
                                               extra_body={"ignore_eos": True, "top_k": 0}))
    assert [c.choices[0].text for c in omitted] == [g.text for g in greedy]
    assert [c.choices[0].text for c in explicit] != [g.text for g in greedy]


@pytest.mark.skipif(os.environ.get("CI") == "true",
                    reason="10,000 tokens take about a minute on 2 cores (the CPU attention reads "
                           "the whole context every step): run it with CI unset")
def test_a_long_hot_sampled_stream_over_a_padded_vocabulary(api, server, model_dir):
    """10,000 tokens at temperature 1.5 with top_logprobs 5: ids past the tokenizer are sampled
    and listed among the top logprobs; they stream as empty text, with no error."""
    tok_vocab = transformers.AutoTokenizer.from_pretrained(str(model_dir)).vocab_size
    stream = api.chat.completions.create(
        model=server.served_model_name, messages=[{"role": "user", "content": "hello"}],
        max_tokens=10000, temperature=1.5, top_p=1.0, logprobs=True, top_logprobs=5, seed=11,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "top_k": 0})
    tokens = empty = 0
    finish, usage = None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            for lp in (choice.logprobs.content or []) if choice.logprobs else []:
                tokens += 1
                empty += lp.token == ""
                assert len(lp.top_logprobs) == 5
            finish = choice.finish_reason or finish
    assert finish == "length" and tokens == 10000 and usage.completion_tokens == 10000
    # 128 of the model's ids are past the tokenizer: at temperature 1.5 they come up often
    assert empty > 100, f"only {empty} empty tokens: were padded ids ever sampled?"
    assert tok_vocab < 10000
