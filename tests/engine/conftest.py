"""Fixtures of the engine's tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    from pd.engine.grammar import Grammars
    from pd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return Grammars(tiny_model_dir, config["vocab_size"], tuple(tok.eos_token_ids))
