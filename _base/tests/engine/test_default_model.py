"""The embedded default model through the project's own engine: `LLM()` with no model named
loads `pd/assets/pd-tiny-code`, and greedy decoding reproduces the completion recorded from the
shipped weights (the same golden text `tests/tools/test_shipped_model.py` checks through
`transformers`), so a loader or model regression shows here."""
from __future__ import annotations

import pytest
import torch

from pd.config import default_model_dir
from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):"
GOLDEN = '\n    """\n    Return a list of all the results in the given list of all\n    elements.\n    """\n    if n'
GOLDEN_IDS = [283, 441, 283, 1990, 325, 775, 474, 1070, 343, 2421, 329, 343, 1829, 775, 474,
              1070, 283, 4066, 16, 283, 441, 283, 358, 327]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_default_model_is_the_embedded_one():
    path = default_model_dir()
    assert path.name == "pd-tiny-code" and (path / "model.safetensors").is_file()


def test_golden_greedy_completion(one_thread):
    llm = LLM()
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))
    assert out.token_ids == GOLDEN_IDS
    assert out.text == GOLDEN
