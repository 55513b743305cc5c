"""`argmax`: the column of each row's largest value, the lowest column on ties (torch's rule),
as two Triton kernels with a torch twin.

Greedy decoding takes it over a batch's logits [B, V] every step. torch's reduction gives one
block to a row, so one row of a 128k vocabulary takes ~28 us on an H100; here the first kernel
splits each row into chunks of `CHUNK` columns (one program each: the chunk's max and its
column), the second picks each row's best chunk, the leftmost among equals, so ties still go
to the lowest column; a row of one chunk (a small vocabulary) is the first kernel's alone. A NaN
is the largest value, as in torch (the first NaN's column; one after a +inf in its row loses to
it, where torch would take the NaN). Each row may name ids to pass over (`bans`, -1 for none:
a greedy row under min_tokens may not take EOS yet), read in the first kernel, so a decode
graph's argmax serves such rows too. On the current stream, capturable in a CUDA graph.
`triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch

from pd_kernels.triton_support import triton_usable

CHUNK = 4096  # columns per program of the first kernel


@functools.cache
def _kernels():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def argmax_chunk_kernel(x_ptr, val_ptr, col_ptr, out_ptr, bans_ptr, stride_x, stride_out,
                            stride_bans, n_cols, num_chunks, CHUNK: tl.constexpr,
                            DIRECT: tl.constexpr, NUM_BANS: tl.constexpr):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        # NOTE: a NaN counts as the largest value, as torch's argmax has it (the reduction's
        # comparisons would pass over it: a row of NaN picked a padding column past the
        # vocabulary, whose id then indexed the embedding out of range)
        x = tl.where(x != x, float("inf"), x)
        for j in tl.static_range(NUM_BANS):  # the row's banned ids (-1: none) pass for -inf
            x = tl.where(cols == tl.load(bans_ptr + row * stride_bans + j), float("-inf"), x)
        best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        if DIRECT:  # one chunk per row: its column is the row's
            tl.store(out_ptr + row * stride_out, at.to(tl.int64))
        else:
            tl.store(val_ptr + row * num_chunks + c, best)
            tl.store(col_ptr + row * num_chunks + c, c * CHUNK + at)

    @triton.jit
    def argmax_row_kernel(val_ptr, col_ptr, out_ptr, stride_out, num_chunks, CP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, CP)
        vals = tl.load(val_ptr + row * num_chunks + j, mask=j < num_chunks, other=float("-inf"))
        _, best = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row * stride_out, tl.load(col_ptr + row * num_chunks + best).to(tl.int64))

    return argmax_chunk_kernel, argmax_row_kernel


def argmax_ref(x: torch.Tensor, bans: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: [B, V] -> [B] int64, passing over each row's `bans` [B, K] (-1: none;
    an id past the vocabulary bans nothing, as in the kernel)."""
    if bans is not None:  # a ban of none marks the column past the last, dropped
        rows, cols = x.shape
        banned = torch.zeros(rows, cols + 1, dtype=torch.bool, device=x.device).scatter_(
            1, torch.where((bans >= 0) & (bans < cols), bans, cols), True)[:, :cols]
        x = x.float().masked_fill(banned, float("-inf"))
    return x.argmax(dim=-1)


def argmax(x: torch.Tensor, out: torch.Tensor | None = None,
           use_kernel: bool | None = None, bans: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax of x [B, V] (float32, bfloat16 or float16) -> [B] int64, written into
    `out` when given (any stride: a column of a wider result): the kernels on CUDA (one where a
    row is one chunk), else the twin. `bans` [B, K] int64: ids row i may not take (-1: none)."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax takes [rows, columns], got {tuple(x.shape)}")
    if out is not None and (out.shape != x.shape[:1] or out.dtype != torch.int64):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit {x.shape[0]} rows")
    if bans is not None and (bans.dim() != 2 or bans.shape[0] != x.shape[0]
                             or bans.dtype != torch.int64 or bans.stride(-1) != 1):
        raise ValueError(f"bans {tuple(bans.shape)} {bans.dtype} do not fit {x.shape[0]} rows")
    if use_kernel is None:
        use_kernel = triton_usable(x, "argmax") and x.stride(-1) == 1
    if not use_kernel:
        result = argmax_ref(x, bans)
        return result if out is None else out.copy_(result)
    if x.stride(-1) != 1:
        raise ValueError("argmax needs contiguous rows")
    rows, cols = x.shape
    num_chunks = -(-cols // CHUNK)
    out = torch.empty(rows, dtype=torch.int64, device=x.device) if out is None else out
    chunk_kernel, row_kernel = _kernels()
    num_bans, ban_args = (0, (out, 0)) if bans is None else (bans.shape[1], (bans, bans.stride(0)))
    if num_chunks == 1:
        chunk_kernel[(rows, 1)](x, out, out, out, ban_args[0], x.stride(0), out.stride(0),
                                ban_args[1], cols, 1, CHUNK=CHUNK, DIRECT=True,
                                NUM_BANS=num_bans, num_warps=8)
        return out
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    at = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    chunk_kernel[(rows, num_chunks)](x, vals, at, out, ban_args[0], x.stride(0), out.stride(0),
                                     ban_args[1], cols, num_chunks, CHUNK=CHUNK, DIRECT=False,
                                     NUM_BANS=num_bans, num_warps=8)
    row_kernel[(rows,)](vals, at, out, out.stride(0), num_chunks,
                        CP=max(16, 1 << (num_chunks - 1).bit_length()), num_warps=1)
    return out
