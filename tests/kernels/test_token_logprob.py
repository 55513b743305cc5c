"""`pd_kernels.token_logprob`: the twin against `pd.engine.logprobs.compute_logprobs` (what the MTP
graphs packed before), the wrapper's checks on CPU, and the Triton kernel against the twin on a
CUDA machine, with tied logits planted around the chosen token (skipped without CUDA;
`benchmarks/gpu/run_all.sh` runs them)."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.token_logprob import CHUNK, split, token_logprob
from tests.kernels.interpreter import run_interpreted
from pd.engine.logprobs import compute_logprobs, pack_logprobs

CUDA = torch.cuda.is_available()


def rows(num_rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and ids; in every other row some columns tie with the chosen token's
    logit (equal logprobs do not count against its rank), some across a chunk border."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 3
    ids = torch.randint(0, vocab, (num_rows,), generator=g)
    for r in range(0, num_rows, 2):
        cols = torch.randint(0, vocab, (3,), generator=g)
        if vocab > CHUNK + 1:
            cols[0] = CHUNK + (r % 2)
        x[r, cols] = x[r, ids[r]].item()
    return x, ids


def test_twin_equals_the_packed_logprobs_and_refuses_bad_shapes():
    x, ids = rows(9, 700, 0)
    assert torch.equal(token_logprob(x, ids), pack_logprobs(compute_logprobs(x, ids, 0)))
    as_ints = token_logprob(x, ids, int_ranks=True)  # the same pairs: float32 bits, int32 rank
    assert as_ints.dtype == torch.int32
    assert torch.equal(as_ints[:, 0].view(torch.float32), token_logprob(x, ids)[:, 0])
    assert torch.equal(as_ints[:, 1].float(), token_logprob(x, ids)[:, 1])
    with pytest.raises(ValueError, match="one id per row"):
        token_logprob(x[0], ids)
    with pytest.raises(ValueError, match="one id per row"):
        token_logprob(x, ids[:3])


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab", [(64, 512), (4, 128256), (13, 4097), (3, 151936), (2, 7)])
def test_kernel_equals_twin(dtype, num_rows, vocab):
    x, ids = rows(num_rows, vocab, num_rows + vocab)
    x, ids = x.to("cuda", dtype), ids.cuda()
    got, want = token_logprob(x, ids, use_kernel=True), token_logprob(x, ids, use_kernel=False)
    assert torch.allclose(got[:, 0], want[:, 0], atol=2e-5, rtol=0), (got[:, 0] - want[:, 0]).abs().max()
    assert torch.equal(got[:, 1], want[:, 1]), (got[:, 1], want[:, 1])
    as_ints = token_logprob(x, ids, use_kernel=True, int_ranks=True)
    assert torch.equal(as_ints, torch.cat([got[:, :1].view(torch.int32), got[:, 1:].int()], 1))
    sliced = x[:, : max(1, vocab - 3)]  # a row stride wider than the row
    ids = ids.clamp(max=sliced.shape[1] - 1)
    assert torch.equal(token_logprob(sliced, ids, use_kernel=True)[:, 1],
                       token_logprob(sliced, ids, use_kernel=False)[:, 1])


@pytest.mark.parametrize("num_rows", [1, 4, 13, 64, 100, 1024])
@pytest.mark.parametrize("vocab", [7, 512, 4097, 32000, 128256, 151936])
def test_rows_are_cut_into_segments_that_cover_them(num_rows, vocab):
    seg, parts, block = split(num_rows, vocab)
    assert seg % block == 0 and block <= CHUNK and 1 <= parts <= 64
    assert (parts - 1) * seg < vocab <= parts * seg  # every column in one segment, none empty
    assert parts == 1 or seg >= 1024
    if num_rows <= 4 and vocab >= 128256:  # an MTP step's rows at batch 1: many programs each
        assert parts >= 32


def test_twin_reads_ids_in_groups_and_writes_into_a_view():
    x, ids = rows(12, 300, 3)
    result = torch.full((3, 7), -1, dtype=torch.int64)  # an MTP step's result: k + 1 = 4 columns
    result[:, :4] = ids.view(3, 4)
    result[2, 3] = -1  # a place with no token: its pair is meaningless, read as column 0
    buffer = torch.zeros(3, 7 + 4, dtype=torch.int64)
    out = buffer[:, 7:].view(torch.int32).view(3, 4, 2)
    assert token_logprob(x, result[:, :4], int_ranks=True, out=out) is out
    want = token_logprob(x, result[:, :4].clamp(min=0).reshape(-1), int_ranks=True)
    assert torch.equal(out.reshape(12, 2), want)
    assert torch.equal(buffer[:, :7], torch.zeros(3, 7, dtype=torch.int64))  # nothing else written
    with pytest.raises(ValueError, match="out must be"):
        token_logprob(x, result[:, :4], out=out)  # float32 pairs into int32


def test_kernel_reads_ids_in_groups_and_writes_into_a_view():
    """On a CUDA machine the compiled kernel; elsewhere triton's interpreter runs it (CPU)."""
    if CUDA:
        check_groups("cuda")
    else:
        run_interpreted("from tests.kernels.test_token_logprob import check_groups\n"
                        "check_groups('cpu')\nprint('ok')")


def check_groups(device: str) -> None:
    """The kernel reading an MTP step's accepted columns in place (ids [G, g], a negative id
    reading column 0) and writing its pairs into a view of a larger buffer, against the twin."""
    for num_slots, k1, vocab in ((1, 4, 8192), (16, 2, 700)):  # cut into segments, then whole rows
        x, ids = (t.to(device) for t in rows(num_slots * k1, vocab, vocab))
        result = torch.full((num_slots, 9), -1, dtype=torch.int64, device=device)
        result[:, :k1] = ids.view(num_slots, k1)
        result[0, k1 - 1] = -1
        for int_ranks in (True, False):
            if int_ranks:
                buffer = torch.zeros(num_slots, 9 + k1, dtype=torch.int64, device=device)
                out = buffer[:, 9:].view(torch.int32).view(num_slots, k1, 2)
            else:
                buffer = torch.zeros(num_slots, 9 + 2 * k1, dtype=torch.float32, device=device)
                out = buffer[:, 9:].view(num_slots, k1, 2)
            token_logprob(x, result[:, :k1], use_kernel=True, int_ranks=int_ranks, out=out)
            want = token_logprob(x, result[:, :k1].clamp(min=0).reshape(-1), use_kernel=False,
                                 int_ranks=int_ranks)
            got = out.reshape(-1, 2)
            assert torch.equal(got[:, 1], want[:, 1]), (got, want)
            if int_ranks:
                lp, lp_want = got[:, 0].view(torch.float32), want[:, 0].view(torch.float32)
            else:
                lp, lp_want = got[:, 0], want[:, 0]
            assert torch.allclose(lp, lp_want, atol=2e-5, rtol=0), (lp - lp_want).abs().max()
            assert not buffer[:, :9].any()
        plain = token_logprob(x, ids, use_kernel=True)  # the flat form as before
        assert torch.equal(plain[:, 1], token_logprob(x, ids, use_kernel=False)[:, 1])
