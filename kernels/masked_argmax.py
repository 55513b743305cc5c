"""`masked_argmax`: the greedy token of some rows of a step's logits under their grammars'
bitmasks, written into a step's tokens, as one Triton kernel with a torch twin.

A late row of checked sampling (`pd.engine.checked_grammar`) is sampled again once the host has
its mask, and so is a refused token's position, from the step before's logits: the argmax of
the logits over the tokens the mask allows, the lowest id on ties, as the sampler's masked
greedy row gives it; both kinds of row in one launch. The sampler would copy the rows to
float32, mask them and reduce them in several launches; the kernel reads the logits (bfloat16
or float32) and the mask words once. Each row is cut in chunks of `CHUNK` columns, one program
each (a step's dozen rows over a 128k vocabulary keep the GPU busy: one program per row took
42 us on the H100, most of a late step's own device time); a program writes its chunk's best
value and column, counts itself done on the row's counter, and the row's last program picks
the best chunk, the leftmost among equals, so ties still go to the lowest id. A row whose mask
allows nothing gets token 0 (as torch's argmax of a row of -inf). On the current stream;
`triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch

from kernels.token_mask import apply_token_mask_ref
from kernels.triton_support import triton_usable

CHUNK = 2048  # columns per program


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def masked_argmax_kernel(x_ptr, prev_ptr, bits_ptr, rows_ptr, src_ptr, out_ptr, val_ptr,
                             col_ptr, count_ptr, stride_x, stride_prev, stride_bits, n_cols,
                             n_words, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                             CP: tl.constexpr):
        m, c = tl.program_id(0), tl.program_id(1)
        row = tl.load(rows_ptr + m)
        src = tl.load(src_ptr + m)
        base = tl.where(src >= 0, x_ptr + src * stride_x, prev_ptr + (-src - 1) * stride_prev)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        word = cols >> 5
        w = tl.load(bits_ptr + row * stride_bits + word, mask=(cols < n_cols) & (word < n_words),
                    other=0)
        allowed = (((w >> (cols & 31)) & 1) != 0) & (cols < n_cols)
        x = tl.load(base + cols, mask=allowed, other=float("-inf"))
        best, at = tl.max(x.to(tl.float32), 0, return_indices=True,
                          return_indices_tie_break_left=True)
        if NUM_CHUNKS == 1:
            tl.store(out_ptr + row, at.to(tl.int64))
            return
        tl.store(val_ptr + m * NUM_CHUNKS + c, best)
        tl.store(col_ptr + m * NUM_CHUNKS + c, c * CHUNK + at)
        # NOTE: the row's last program to finish picks its best chunk: its stores are done
        # (barrier) before the release of the count, whose acquire by the last one makes the
        # others' visible to its loads (which bypass L1); it leaves the count at zero again
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + m, 1, sem="acq_rel") == NUM_CHUNKS - 1:
            tl.atomic_xchg(count_ptr + m, 0)
            j = tl.arange(0, CP)
            vals = tl.load(val_ptr + m * NUM_CHUNKS + j, mask=j < NUM_CHUNKS,
                           other=float("-inf"), cache_modifier=".cg")
            _, k = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(out_ptr + row, tl.load(col_ptr + m * NUM_CHUNKS + k, cache_modifier=".cg")
                     .to(tl.int64))

    return masked_argmax_kernel


# per device: the chunks' best values and columns, and the rows' counters (zero between
# launches), grown as a launch needs; one launch at a time per device (the decode loop's)
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, rows: int, chunks: int):
    have = _SCRATCH.get(device)
    if have is None or have[2].numel() < rows or have[0].numel() < rows * chunks:
        n = 1 << max(5, (rows - 1).bit_length())
        have = _SCRATCH[device] = (
            torch.empty(n * chunks, dtype=torch.float32, device=device),
            torch.empty(n * chunks, dtype=torch.int32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device))
    return have


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
    chunks = -(-x.shape[1] // CHUNK)
    vals, cols, counts = _scratch(x.device, rows.numel(), chunks)
    _kernel()[(rows.numel(), chunks)](
        x, prev, bits, rows, rows if src is None else src, out, vals, cols, counts, x.stride(0),
        prev.stride(0), bits.stride(0), x.shape[1], bits.shape[1], CHUNK=CHUNK,
        NUM_CHUNKS=chunks, CP=max(16, 1 << (chunks - 1).bit_length()), num_warps=4)
