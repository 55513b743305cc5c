"""pd.text.tokenizer against transformers.AutoTokenizer on the same directories."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models

from pd.testing.tiny import ENDOFTEXT, IM_END, IM_START, tiny_tokenizer, write_tokenizer_files
from pd.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x  # comment\n\n\n",
    "  leading and trailing spaces   ",
    "tabs\tand\r\nwindows newlines",
    "unicode: héllo, 世界, emoji 🤖, combining e\u0301",
    f"special {IM_START}user\nhi{IM_END} {ENDOFTEXT} tail",
    "<|im_start partial tokens <| |>",
]

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3? 世界 🤖"}],
]

CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'stop' %}{% break %}{% endif %}"
    "[{{ m['role'] | upper }}] {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}"
    "{% if tools is defined and tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% if pad_token is defined %}pad={{ pad_token }}{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def ours(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def theirs(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory):
    """A Llama-style tokenizer: the post-processor prepends a BOS, the template prints one."""
    tok = tiny_tokenizer()
    bos_id = tok.token_to_id(ENDOFTEXT)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{ENDOFTEXT} $A", pair=f"{ENDOFTEXT} $A $B",
                                      special_tokens=[(ENDOFTEXT, bos_id)]),
    ])
    out = tmp_path_factory.mktemp("bos-tokenizer")
    write_tokenizer_files(out, tok, model_max_length=256, bos_token=ENDOFTEXT, eos_token=IM_END,
                          pad_token=None, chat_template=CUSTOM_TEMPLATE)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return out


def _copy_tokenizer(src, dst, **config_changes):
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_match_transformers(ours, theirs, text, add_special):
    ids = ours.encode(text, add_special_tokens=add_special)
    assert ids == theirs.encode(text, add_special_tokens=add_special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_random_text_matches_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, gen_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    assert text == theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen_prompt)
    assert text.endswith("<|im_start|>assistant\n") == gen_prompt
    expected_ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=gen_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=gen_prompt) == list(expected_ids)


def test_special_ids_and_vocab(ours, theirs):
    assert ours.vocab_size == len(theirs) == 512
    assert ours.eos_token_id == theirs.eos_token_id == ours.token_to_id(ENDOFTEXT)
    assert ours.eos_token_ids == (ours.token_to_id(ENDOFTEXT), ours.token_to_id(IM_END))
    assert ours.bos_token_id is None and not ours.adds_bos_on_encode
    assert ours.prefix_special_ids == () and ours.suffix_special_ids == ()
    assert ours.all_special_ids == {ours.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)}
    for i in range(ours.vocab_size):
        tok = ours.id_to_token(i)
        assert tok == theirs.convert_ids_to_tokens(i)
        assert ours.token_to_id(tok) == i
    assert ours.token_to_id("no such token here") is None
    assert ours.id_to_token(ours.vocab_size) is None


def test_bos_post_processor_and_custom_template(bos_dir):
    ours = Tokenizer.from_dir(bos_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(bos_dir))
    bos = ours.token_to_id(ENDOFTEXT)
    assert ours.bos_token_id == bos and ours.adds_bos_on_encode
    assert ours.prefix_special_ids == (bos,) and ours.suffix_special_ids == ()
    for text in TEXTS:
        with_bos = ours.encode(text)
        assert with_bos == theirs.encode(text)
        assert with_bos[0] == bos
        assert ours.encode(text, add_special_tokens=False) == with_bos[1:]
    # generation_config says 0 (<|endoftext|>), tokenizer_config says <|im_end|>: the union
    assert ours.eos_token_ids == (bos, ours.token_to_id(IM_END))

    messages = [{"role": "user", "content": "hi"}, {"role": "skip", "content": "gone"},
                {"role": "assistant", "content": "yo"}, {"role": "stop", "content": "x"},
                {"role": "user", "content": "never"}]
    tools = [{"name": "wéather", "args": {"city": "東京"}}]
    for gen_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt, tools=tools)
        assert text == theirs.apply_chat_template(messages, tokenize=False, tools=tools,
                                                  add_generation_prompt=gen_prompt)
    assert text.startswith(f"{ENDOFTEXT}[USER] hi[ASSISTANT] yoTOOLS ")  # trim_blocks
    assert "gone" not in text and "never" not in text and "pad=" not in text
    assert 'TOOLS [{"name": "wéather", "args": {"city": "東京"}}]' in text
    # the template's BOS is the only one: encode_chat adds none of its own
    ids = ours.encode_chat(messages[:1])
    assert ids[0] == bos and ids[1] != bos


def test_template_from_jinja_file(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "m", chat_template=None)
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == "<hi>"


def test_raise_exception_in_template(ours, theirs):
    bad = [{"role": "user", "content": ["a", "list"]}]
    with pytest.raises(ChatTemplateError, match="message content must be a string"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="message content must be a string"):
        theirs.apply_chat_template(bad, tokenize=False)


def test_template_syntax_error_is_reported_on_use(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "m", chat_template="{% for m in messages %}")
    tok = Tokenizer.from_dir(d)  # encoding still works without a usable template
    assert tok.encode("hi") == Tokenizer.from_dir(tiny_dir).encode("hi")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(CHATS[0])


def test_template_is_sandboxed(tiny_dir, tmp_path):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    d = _copy_tokenizer(tiny_dir, tmp_path / "m", chat_template=escape)
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(d).apply_chat_template(CHATS[0])


def test_missing_template(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "m", chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template(CHATS[0])


def test_missing_and_broken_files(tiny_dir, tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "empty")
    d = _copy_tokenizer(tiny_dir, tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="missing tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_dir(d)
    d2 = _copy_tokenizer(tiny_dir, tmp_path / "m2", eos_token="<|not-a-token|>")
    with pytest.raises(TokenizerError, match="eos_token"):
        Tokenizer.from_dir(d2)
    (tmp_path / "m3").mkdir()
    (tmp_path / "m3" / "tokenizer.json").write_text('{"garbage": 1}')
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_dir(tmp_path / "m3")


def test_generation_config_eos_forms(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "m")
    im_end = Tokenizer.from_dir(tiny_dir).token_to_id(IM_END)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert Tokenizer.from_dir(d).eos_token_ids == (im_end, 0)
    (d / "generation_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_token_ids == (0,)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_dir(d)


def test_added_token_map_form_and_bpe_no_cleanup(tiny_dir, tmp_path):
    d = _copy_tokenizer(tiny_dir, tmp_path / "m", clean_up_tokenization_spaces=True,
                        eos_token={"__type": "AddedToken", "content": IM_END,
                                   "lstrip": False, "rstrip": False, "normalized": False,
                                   "single_word": False, "special": True})
    ours, theirs = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.eos_token_id == theirs.eos_token_id == ours.token_to_id(IM_END)
    text = "I do n't know . Are you sure ? yes , it 's fine !"
    ids = ours.encode(text)
    # transformers 5 never cleans up a BPE model's output: the spaces are real
    assert ours.decode(ids) == theirs.decode(ids) == text


def test_cleanup_on_wordpiece(tmp_path):
    words = ["[UNK]", "[SEP]", "i", "don", "'", "t", "know", ".", "it", "s", "fine", "!"]
    tok = HFTokenizer(tok_models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens(["[SEP]"])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
         "eos_token": "[SEP]", "unk_token": "[UNK]"}))
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ours.encode("i don't know. it's fine!")
    assert ids == theirs.encode("i don't know. it's fine!")
    assert ours.decode(ids) == theirs.decode(ids) == "i don't know. it's fine!"


def test_ids_past_the_tokenizer_decode_as_empty_text(ours):
    # a model vocabulary padded beyond the tokenizer's (Qwen2.5: 152064 rows, 151665 tokens)
    ids = ours.encode("def f(x):")
    assert ours.decode(ids + [ours.vocab_size, ours.vocab_size + 400]) == ours.decode(ids)
    assert ours.decode([ours.vocab_size]) == ""
    with pytest.raises(ValueError, match="negative"):
        ours.decode([-1])
