"""`masked_argmax`: the greedy token of some rows of a step's logits under their grammars'
bitmasks, written into a step's tokens, as one Triton kernel with a torch twin.

A late row of checked sampling (`pd.engine.checked_grammar`) is sampled again once the host has
its mask, and so is a refused token's position, from the step before's logits: the argmax of
the logits over the tokens the mask allows, the lowest id on ties, as the sampler's masked
greedy row gives it; both kinds of row in one launch. The sampler would copy the rows to
float32, mask them and reduce them in several launches; the kernel reads the logits (bfloat16
or float32) and the mask words once, one program per row walking the vocabulary in `BLOCK`
columns. A row whose
mask allows nothing gets token 0 (as torch's argmax of a row of -inf). On the current stream;
`triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch

from kernels.token_mask import apply_token_mask_ref
from kernels.triton_support import triton_usable

BLOCK = 4096  # columns per iteration of a row's program


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def masked_argmax_kernel(x_ptr, prev_ptr, bits_ptr, rows_ptr, src_ptr, out_ptr, stride_x,
                             stride_prev, stride_bits, n_cols, n_words, BLOCK: tl.constexpr,
                             NUM_BLOCKS: tl.constexpr):
        row = tl.load(rows_ptr + tl.program_id(0))
        src = tl.load(src_ptr + tl.program_id(0))
        base = tl.where(src >= 0, x_ptr + src * stride_x, prev_ptr + (-src - 1) * stride_prev)
        best = tl.full((), float("-inf"), tl.float32)
        at = tl.full((), 0, tl.int32)
        # NOTE: a constant trip count (the vocabulary's blocks): triton's interpreter on the
        # H100 machine took a loop bounded by an argument for a one-element array
        for b in range(NUM_BLOCKS):
            start = b * BLOCK
            cols = start + tl.arange(0, BLOCK)
            word = cols >> 5
            w = tl.load(bits_ptr + row * stride_bits + word,
                        mask=(cols < n_cols) & (word < n_words), other=0)
            allowed = (((w >> (cols & 31)) & 1) != 0) & (cols < n_cols)
            x = tl.load(base + cols, mask=allowed, other=float("-inf"))
            v, i = tl.max(x.to(tl.float32), 0, return_indices=True,
                          return_indices_tie_break_left=True)
            take = v > best  # strictly: an equal value further on keeps the lower id
            at = tl.where(take, start + i, at)
            best = tl.where(take, v, best)
        tl.store(out_ptr + row, at.to(tl.int64))

    return masked_argmax_kernel


def _sources(x: torch.Tensor, prev: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """The rows src names: x[s] for s >= 0, prev[-s - 1] for s < 0."""
    if prev is None:
        return x[src]
    own = src >= 0
    return torch.where(own.unsqueeze(1), x[src.clamp(min=0)],
                       prev[(-src - 1).clamp(min=0)].to(x.dtype))


def masked_argmax_ref(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor,
                      out: torch.Tensor, src: torch.Tensor | None = None,
                      prev: torch.Tensor | None = None) -> None:
    """The torch twin: out[rows[m]] = argmax of the row src[m] names over the tokens
    bits[rows[m]] allows."""
    if not rows.numel():
        return
    y = _sources(x, prev, rows if src is None else src).float()
    apply_token_mask_ref(y, bits[rows], torch.arange(rows.numel(), device=x.device))
    out[rows] = y.argmax(dim=-1)


def masked_argmax(x: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                  src: torch.Tensor | None = None, prev: torch.Tensor | None = None,
                  use_kernel: bool | None = None) -> None:
    """In place on out [B] int64: for each m, out[rows[m]] = the argmax of a row of logits
    over the tokens bits[rows[m]] allows (bits [B, W] int32: bit t % 32 of word t // 32 allows
    token t; tokens past the words are not allowed), the lowest id on ties. The row is
    x[src[m]] where src[m] >= 0, else prev[-src[m] - 1] (another step's logits, of the same
    dtype and vocabulary); src [M] int64 defaults to rows. x and prev [S, V] bfloat16, float16
    or float32. All on x's device. The kernel on CUDA, else the twin."""
    if (x.dim() != 2 or bits.dim() != 2 or rows.dim() != 1 or out.dim() != 1
            or bits.shape[0] != out.shape[0] or (src is not None and src.shape != rows.shape)
            or (prev is not None and (prev.dim() != 2 or prev.shape[1] != x.shape[1]
                                      or prev.dtype != x.dtype))):
        raise ValueError(f"logits {tuple(x.shape)}, bitmask {tuple(bits.shape)}, rows "
                         f"{tuple(rows.shape)} and out {tuple(out.shape)} do not fit")
    if (bits.dtype != torch.int32 or rows.dtype != torch.int64 or out.dtype != torch.int64
            or (src is not None and src.dtype != torch.int64)):
        raise ValueError(f"want int32 words, int64 rows and int64 out, got {bits.dtype}, "
                         f"{rows.dtype}, {out.dtype}")
    if use_kernel is None:
        use_kernel = triton_usable(x)
    if not use_kernel:
        masked_argmax_ref(x, bits, rows, out, src, prev)
        return
    if not rows.numel():
        return
    prev = x if prev is None else prev
    if (x.stride(-1) != 1 or prev.stride(-1) != 1 or bits.stride(-1) != 1
            or not out.is_contiguous()):
        raise ValueError("masked_argmax needs contiguous rows and tokens")
    _kernel()[(rows.numel(),)](x, prev, bits, rows, rows if src is None else src, out,
                               x.stride(0), prev.stride(0), bits.stride(0), x.shape[1],
                               bits.shape[1], BLOCK=BLOCK, NUM_BLOCKS=-(-x.shape[1] // BLOCK),
                               num_warps=8)
