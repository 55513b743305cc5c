"""`apply_token_mask`: -inf on every token a grammar's bitmask does not allow, in place on a
step's logits, as one Triton kernel with a torch twin.

Structured output masks each constrained row of the float32 logits [B, V] by its grammar's
bitmask (int32 words, bit t % 32 of word t // 32 allows token t; `pd.engine.grammar`); tokens
past the mask's words are not allowed. The twin does it in eight torch operations (a gather of
each column's word, shift, and, compare, masked fill, index and put); the kernel in one launch,
one program per (masked row, `BLOCK` columns). On the current stream; `triton` is imported on
first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools
import math

import torch

from pd_kernels.triton_support import triton_usable

BLOCK = 4096  # columns per program


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def token_mask_kernel(x_ptr, bits_ptr, rows_ptr, stride_x, n_cols, n_words,
                          BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + m)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        word = cols >> 5
        w = tl.load(bits_ptr + m * n_words + word, mask=(cols < n_cols) & (word < n_words),
                    other=0)
        banned = ((w >> (cols & 31)) & 1) == 0
        tl.store(x_ptr + row * stride_x + cols, float("-inf"), mask=banned & (cols < n_cols))

    return token_mask_kernel


_TOKEN_BITS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def apply_token_mask_ref(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """The torch twin: x[rows[m]] gets -inf where bits[m] does not allow the token."""
    dev, vocab = x.device, x.shape[1]
    key = (dev, vocab)
    if key not in _TOKEN_BITS:
        t = torch.arange(vocab, device=dev)
        _TOKEN_BITS[key] = (t >> 5, (t & 31).to(torch.int32))
    word, bit = _TOKEN_BITS[key]
    width = bits.shape[1]
    allowed = (bits[:, word.clamp(max=width - 1)] >> bit) & 1  # [M, V]
    if 32 * width < vocab:
        allowed[:, 32 * width:] = 0
    x[rows] = x[rows].masked_fill(allowed == 0, -math.inf)


def apply_token_mask(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor,
                     use_kernel: bool | None = None) -> None:
    """In place on x [B, V] float32: row rows[m] keeps only the tokens bits[m] allows (bits
    [M, W] int32 and rows [M] int64, both on x's device; rows distinct). The kernel on CUDA,
    else the twin."""
    if x.dim() != 2 or bits.dim() != 2 or rows.shape != bits.shape[:1]:
        raise ValueError(f"logits {tuple(x.shape)}, bitmask {tuple(bits.shape)} and rows "
                         f"{tuple(rows.shape)} do not fit")
    if bits.dtype != torch.int32 or rows.dtype != torch.int64 or x.dtype != torch.float32:
        raise ValueError(f"want float32 logits, int32 words and int64 rows, got {x.dtype}, "
                         f"{bits.dtype}, {rows.dtype}")
    if use_kernel is None:
        use_kernel = triton_usable(x, "token_mask") and x.stride(-1) == 1
    if not use_kernel:
        apply_token_mask_ref(x, bits, rows)
        return
    if not rows.numel():
        return
    bits = bits.contiguous()
    grid = (rows.numel(), -(-x.shape[1] // BLOCK))
    _kernel()[grid](x, bits, rows, x.stride(0), x.shape[1], bits.shape[1], BLOCK=BLOCK,
                    num_warps=4)
