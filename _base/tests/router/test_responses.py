"""The SSE bytes of a chunk: the per-request template (`ResponseFormat.sse_chunk`) gives exactly
the bytes of the chunk serialised whole, whatever the endpoint, text and ending."""

import json

import pytest

from router.choice import Delta
from router.responses import ResponseFormat, sse


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("delta", [
    Delta(0, text="hello"), Delta(3, text='a "quoted"\\ line\n\u00e9\u4e2d \U0001f600'),
    Delta(1, text="", finish_reason="stop"), Delta(0, text="end", finish_reason="length"),
    Delta(2, text="")])
def test_plain_chunk_bytes_equal_the_whole_chunk_serialised(endpoint, include_usage, delta):
    fmt = ResponseFormat(endpoint, "cmpl-x\u00e9", "model/\"name\"", want_logprobs=False,
                         include_usage=include_usage)
    fast = fmt.sse_chunk(delta)
    assert fast == sse(fmt.chunk(delta))
    assert json.loads(fast[len(b"data: "):])["choices"][0]["index"] == delta.index


def test_chunks_with_logprobs_or_continuous_usage_take_the_whole_path():
    fmt = ResponseFormat("completions", "cmpl-x", "m", want_logprobs=True)
    d = Delta(0, text="x")
    assert fmt.sse_chunk(d) == sse(fmt.chunk(d))  # completions with logprobs: empty lists
    fmt = ResponseFormat("chat", "c", "m", want_logprobs=False, include_usage=True,
                         continuous_usage=True)
    u = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert fmt.sse_chunk(d, u) == sse(fmt.chunk(d, u))
    assert json.loads(fmt.sse_chunk(d, u)[6:])["usage"] == u
