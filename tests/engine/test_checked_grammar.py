"""Checked sampling (`pd.engine.checked_grammar`, `pd.engine.grammar_steps`): greedy rows whose
grammar is checked after sampling give the tokens of rows sampled under their masks, with and
without overlap, and none is checked below CHECK_FROM_ROWS rows; after a refusal the masked
steps back off and come back to one, and a refusal the mask could not help ends the request.
`PD_TEST_DEVICE=cuda` runs the engines on the GPU."""

from __future__ import annotations

import pytest

from pd.wire.sampling_params import SamplingParams as SP
from tests.engine.test_grammar import DEVICE, SPECS


@pytest.mark.parametrize("overlap,threads", [(False, False), (True, False), (True, True)])
def test_checked_sampling_equals_masked_sampling(tiny_model_dir, overlap, threads, monkeypatch):
    """Greedy rows checked after sampling (a step of CHECK_FROM_ROWS or more of them) give the
    tokens of rows sampled under their masks (PD_CHECKED_GRAMMAR=0), with tokens taken back on
    the way (this small model leaves the grammars often) and, with overlap, fewer steps whose
    sampler waited for the step before; below CHECK_FROM_ROWS rows every row is masked. With
    `threads` the masks are filled on the filler's threads as over a large vocabulary (this
    one's are too cheap for them), the late rows' while the loop prepares the next step."""
    import threading

    from pd.engine import grammar, grammar_steps
    from pd.engine.llm import LLM

    pooled = []
    if threads:
        fill = grammar._FILLER._fill
        monkeypatch.setattr(grammar._FILLER, "parts", lambda n: min(2, n))
        monkeypatch.setattr(grammar._FILLER, "_fill", lambda *a: pooled.append(
            threading.current_thread() is not threading.main_thread()) or fill(*a))

    prompts = [[3 + (11 * i + j) % 300 for i in range(9)] for j in range(3 * len(SPECS))]
    # min_tokens on some: their late rows' masks leave EOS out too, and on some of those more
    # stop ids than a row of the masked argmax's work carries (cleared from the mask instead)
    params = [SP(max_tokens=24, temperature=0.0, structured_output=SPECS[j % len(SPECS)],
                 min_tokens=12 * (j % 2), stop_token_ids=tuple(range(40, 40 + 3 * (j % 4))))
              for j in range(len(prompts))]
    runs, loops = {}, {}
    assert len(prompts) >= grammar_steps.CHECK_FROM_ROWS
    for mode in ("checked", "masked", "few"):
        monkeypatch.setenv("PD_CHECKED_GRAMMAR", "0" if mode == "masked" else "1")
        llm = LLM(tiny_model_dir, num_blocks=256, overlap=overlap, device=DEVICE,
                  dtype="float32")
        n = grammar_steps.CHECK_FROM_ROWS - 1 if mode == "few" else len(prompts)
        runs[mode] = [o.token_ids for o in llm.generate(prompts[:n], params[:n])]
        loops[mode] = llm.engine.loop
    assert runs["checked"] == runs["masked"] and runs["few"] == runs["masked"][:n]
    assert loops["checked"].num_taken_back > 0
    assert loops["masked"].num_taken_back == loops["few"].num_taken_back == 0
    if overlap:  # masked rows make a step wait for the one before; checked ones do not,
        # nor, sampled late, the masked steps after a refusal, nor the refused position itself,
        # sampled in the step after from the refused step's logits
        assert loops["checked"].num_deferred < loops["masked"].num_deferred
        assert loops["checked"].num_resampled > loops["checked"].num_fixed > 0
    assert loops["masked"].num_resampled == loops["few"].num_resampled == 0
    assert not threads or any(pooled)


def test_checked_sampling_masks_after_refusals_and_gives_up_on_an_empty_mask():
    """After a refusal the next FIRST_MASKED steps sample masked, then twice, four times ...
    as many (up to MAX_MASKED) while refusals keep coming, back to FIRST_MASKED after CALM
    tokens past the masked run without one; a masked step launched ahead of its input's token
    is sampled late; a second refusal at the same position (the mask allowed nothing) ends the
    request as unchecked ones do; a loop that is not checking masks every step."""
    from pd.engine.checked_grammar import CheckedSampling
    from pd.engine.grammar import GrammarState

    class Matcher:  # refuses the token 0, accepts any other
        stop_token_ids = []

        def is_terminated(self):
            return False

        def accept_token(self, t):
            return t != 0

    first, top, calm = (CheckedSampling.FIRST_MASKED, CheckedSampling.MAX_MASKED,
                        CheckedSampling.CALM)
    assert 1 < first and 4 * first <= top
    state = GrammarState(Matcher(), 64, checked=True)
    c = state.checked
    assert c.launch(False) and state.masks_now  # not checking: masked
    assert not c.launch(True) and not state.masks_now
    state.walk(0)
    assert c.refused and not state.failed
    c.take_back()
    assert [c.launch(True) for _ in range(first + 1)] == [True] * first + [False]
    for want in (2 * first, 4 * first):  # refused again soon after: longer masked runs
        state.walk(5)
        state.walk(0)
        c.take_back()
        assert [c.launch(True) for _ in range(want + 1)] == [True] * want + [False]
    for _ in range(4 * first + calm - 1):  # the masked run, then not quite calm
        state.walk(5)
    state.walk(0)
    c.take_back()
    longest = min(8 * first, top)
    assert [c.launch(True) for _ in range(longest + 1)] == [True] * longest + [False]
    for _ in range(longest + calm):  # calm: the first run's length again
        state.walk(5)
    state.walk(0)
    c.take_back()
    assert [c.launch(True) for _ in range(first + 1)] == [True] * first + [False]
    state.walk(5)
    state.walk(0)
    c.take_back()  # a masked step of a loop that can sample late: no mask at the launch
    for _ in range(2 * first):  # refused soon after the last: a run twice as long
        assert not c.launch(True, late=True) and state.masks_late and not state.masks_now
    assert not c.launch(True, late=True) and not state.masks_late  # checked again
    state.walk(0)  # refused again at that position: the masked step's token too
    assert state.failed and state.terminated and not c.refused and c.taken_back == 6


def test_a_narrow_late_mask_keeps_the_row_masked():
    """A masked run goes on while the row's late masks are narrow (tokens in under NARROW of
    their pairs of words, every WIDTH_STRIDE-th pair counted: `narrow_masks`) and ends at the
    first wide one."""
    import numpy as np

    from pd.engine.checked_grammar import CheckedSampling, narrow_masks

    stride, words = CheckedSampling.WIDTH_STRIDE, 4008  # 128,256 tokens
    masks = np.zeros((4, words), dtype=np.int32)
    masks[0] = -1  # inside a string: nearly everything
    masks[1, :40] = 0x10  # punctuation: a few hundred tokens
    counted = np.arange(0, words, 2 * stride)  # the first word of each pair counted
    masks[2, counted[:len(counted) // 2 + 1] + 1] = 1  # just over half the pairs counted
    masks[3, counted[:len(counted) // 2 - 1]] = -1  # just under
    assert narrow_masks(masks).tolist() == [False, True, False, True]
    assert narrow_masks(masks[:0]).shape == (0,)
    odd = np.full((2, 1571), -1, dtype=np.int32)  # 50,257 tokens: an odd count of words
    odd[1, :-1] = 0
    assert narrow_masks(odd).tolist() == [False, True]

    c = CheckedSampling()
    assert not c.launch(True, late=True) and not c.masked  # never refused: checked
    c.take_back()
    run = CheckedSampling.FIRST_MASKED
    for _ in range(run):
        assert not c.launch(True, late=True) and c.late
    for _ in range(3):  # narrow masks seen: one more masked step each
        c.masked_narrow()
        assert not c.launch(True, late=True) and c.late
    assert not c.launch(True, late=True) and not c.late and not c.masked  # a wide one: checked
