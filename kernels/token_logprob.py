"""`token_logprob`: each row's raw logprob of one chosen token and its rank, packed [R, 2]
float32 (logprob, rank) as `pd.spec.graphs.pack_logprobs` packs a request with
top_logprobs 0, as one Triton kernel with a torch twin. With `int_ranks` the pair is int32
(the logprob's float32 bits, the rank), for a host that reads ranks as integers.

The rank is 1 + the number of columns whose logprob is strictly greater (`pd.engine.logprobs`).
The twin builds log_softmax of the whole [R, V] in float32 and compares it; the kernel gives
each row one program that walks the row twice, in chunks of up to `CHUNK` columns: the max and
the sum of exponentials (online), then the count of columns above the token, each logprob
formed as log_softmax forms it ((x - max) - log(sum)). Nothing [R, V] is written. On the
current stream, capturable in a CUDA graph. `triton` is imported on first use; CPU machines
run the twin.
"""

from __future__ import annotations

import functools

import torch

from kernels.triton_support import triton_usable

CHUNK = 4096  # columns per pass of one program


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def token_logprob_kernel(x_ptr, ids_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr,
                             INT_RANKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        log_s = tl.log(s)
        tok = tl.load(ids_ptr + row)
        lp_tok = (tl.load(base + tok).to(tl.float32) - m) - log_s
        above = tl.zeros((), tl.int32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            above += tl.sum(((x - m) - log_s > lp_tok).to(tl.int32), 0)
        if INT_RANKS:
            tl.store(out_ptr + row * 2, lp_tok.to(tl.int32, bitcast=True))
            tl.store(out_ptr + row * 2 + 1, above + 1)
        else:
            tl.store(out_ptr + row * 2, lp_tok)
            tl.store(out_ptr + row * 2 + 1, (above + 1).to(tl.float32))

    return token_logprob_kernel


def token_logprob_ref(logits: torch.Tensor, ids: torch.Tensor, int_ranks: bool = False) -> torch.Tensor:
    """The torch twin: [R, V] logits, [R] ids -> [R, 2] float32 (logprob, rank), or int32
    (logprob bits, rank) with `int_ranks`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = lp.gather(-1, ids.view(-1, 1))
    rank = (lp > tok).sum(dim=-1, keepdim=True) + 1
    if int_ranks:
        return torch.cat([tok.view(torch.int32), rank.int()], dim=1)
    return torch.cat([tok, rank.float()], dim=1)


def token_logprob(logits: torch.Tensor, ids: torch.Tensor, use_kernel: bool | None = None,
                  int_ranks: bool = False) -> torch.Tensor:
    """Each row's logprob of `ids[r]` and its rank -> [R, 2] float32 (int32 with `int_ranks`:
    the logprob's bits, the rank): the kernel on CUDA, else the twin."""
    if logits.dim() != 2 or ids.shape != logits.shape[:1]:
        raise ValueError(f"token_logprob takes logits [rows, columns] and one id per row, got "
                         f"{tuple(logits.shape)} and {tuple(ids.shape)}")
    if use_kernel is None:
        use_kernel = triton_usable(logits) and logits.stride(-1) == 1
    if not use_kernel:
        return token_logprob_ref(logits, ids, int_ranks)
    if logits.stride(-1) != 1:
        raise ValueError("token_logprob needs contiguous rows")
    rows, cols = logits.shape
    out = torch.empty(rows, 2, dtype=torch.int32 if int_ranks else torch.float32,
                      device=logits.device)
    block = min(CHUNK, max(16, 1 << (cols - 1).bit_length()))
    _kernel()[(rows,)](logits, ids.to(torch.int64), out, logits.stride(0), cols, BLOCK=block,
                       INT_RANKS=int_ranks, num_warps=8 if block >= 2048 else 4)
    return out
