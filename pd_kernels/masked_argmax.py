"""`masked_argmax`: the greedy token of some rows of a step's logits under their grammars'
bitmasks and banned ids, written into a step's tokens, as one Triton kernel with a torch twin.

A late row of checked sampling (`pd.engine.checked_grammar`) is sampled again once the host has
its mask, and so is a refused token's position, from the step before's logits: the argmax of
the logits over the tokens the mask allows, less the ids min_tokens bans there, the lowest id on
ties, as the sampler's masked greedy row gives it; both kinds of row in one launch. What each
row of work does is one row of `items` (int32): the row of `out` it writes, the row of logits it
reads (x's, or the step before's `prev` for a negative one), the row of `bits` its mask is, and
up to `BANS` banned ids, so that the host sends a step's work and the masks it needs (those of
the rows sampled again alone) in one copy. The sampler would copy the rows to float32, mask
them and reduce them in several launches; the kernel reads the logits (bfloat16 or float32)
and the mask words once. Each row is cut in chunks of `CHUNK` columns, one program each (a
step's dozen rows over a 128k vocabulary keep the GPU busy: one program per row took 42 us on
the H100, most of a late step's own device time); a program writes its chunk's best value and
column, counts itself done on the row's counter, and the row's last program picks the best
chunk, the leftmost among equals, so ties still go to the lowest id. A row whose mask allows
nothing gets token 0 (as torch's argmax of a row of -inf); an allowed NaN is the largest
value, as in `pd_kernels.argmax`. On the current stream; `triton` is
imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch

from pd_kernels.argmax import argmax_ref
from pd_kernels.token_mask import apply_token_mask_ref
from pd_kernels.triton_support import triton_usable

CHUNK = 2048  # columns per program
BANS = 8  # banned ids a row of work carries (-1: none)
ITEM = 3 + BANS  # int32 a row of work: out row, logits row, mask row, banned ids


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def masked_argmax_kernel(x_ptr, prev_ptr, bits_ptr, items_ptr, out_ptr, val_ptr, col_ptr,
                             count_ptr, stride_x, stride_prev, stride_bits, n_cols, n_words,
                             CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, CP: tl.constexpr,
                             ITEM: tl.constexpr):
        m, c = tl.program_id(0), tl.program_id(1)
        item = items_ptr + m * ITEM
        row = tl.load(item)
        src = tl.load(item + 1).to(tl.int64)
        mask_row = tl.load(item + 2).to(tl.int64)
        base = tl.where(src >= 0, x_ptr + src * stride_x, prev_ptr + (-src - 1) * stride_prev)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        word = cols >> 5
        w = tl.load(bits_ptr + mask_row * stride_bits + word,
                    mask=(cols < n_cols) & (word < n_words), other=0)
        allowed = (((w >> (cols & 31)) & 1) != 0) & (cols < n_cols)
        x = tl.load(base + cols, mask=allowed, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # a NaN is the largest, as in `pd_kernels.argmax`
        # NOTE: the bans after the logits' load, which does not wait for theirs
        for i in tl.static_range(3, ITEM):
            x = tl.where(cols == tl.load(item + i), float("-inf"), x)
        best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
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


def items(rows, src=None, mask_rows=None, bans=None) -> torch.Tensor:
    """Rows of work [M, ITEM] int32 on the host: out row rows[m], logits row src[m] (default
    rows[m]), mask row mask_rows[m] (default m) and bans[m] (up to `BANS` ids each)."""
    rows = list(rows)
    t = torch.full((len(rows), ITEM), -1, dtype=torch.int32)
    if rows:
        t[:, 0] = torch.tensor(rows)
        t[:, 1] = torch.tensor(rows if src is None else list(src))
        t[:, 2] = torch.tensor(range(len(rows)) if mask_rows is None else list(mask_rows))
    for m, banned in enumerate(bans or ()):
        t[m, 3:3 + len(banned)] = torch.tensor(banned, dtype=torch.int32)
    return t


def masked_argmax_ref(x: torch.Tensor, bits: torch.Tensor, work: torch.Tensor,
                      out: torch.Tensor, prev: torch.Tensor | None = None) -> None:
    """The torch twin: for each row of work, out[row] = the argmax of the logits row it names
    over the tokens its mask row allows but its banned ids."""
    if not work.shape[0]:
        return
    work = work.long()
    src = work[:, 1]
    if prev is None:
        y = x[src]
    else:
        own = src >= 0
        y = torch.where(own.unsqueeze(1), x[src.clamp(min=0)],
                        prev[(-src - 1).clamp(min=0)].to(x.dtype))
    y = y.float()
    apply_token_mask_ref(y, bits[work[:, 2]], torch.arange(work.shape[0], device=x.device))
    out[work[:, 0]] = argmax_ref(y, work[:, 3:])


def masked_argmax(x: torch.Tensor, bits: torch.Tensor, work: torch.Tensor, out: torch.Tensor,
                  prev: torch.Tensor | None = None, use_kernel: bool | None = None) -> None:
    """In place on out [B] int64, for each row of `work` [M, ITEM] int32 (`items`): out[row] =
    the argmax of a row of logits over the tokens its row of `bits` allows (bits [R, W] int32:
    bit t % 32 of word t // 32 allows token t; tokens past the words are not allowed) but its
    banned ids, the lowest id on ties. The logits row is x[s] for s >= 0, else prev[-s - 1]
    (another step's logits, of the same dtype and vocabulary). x and prev [S, V] bfloat16,
    float16 or float32. All on x's device. The kernel on CUDA, else the twin."""
    if (x.dim() != 2 or bits.dim() != 2 or work.dim() != 2 or out.dim() != 1
            or work.shape[1] != ITEM
            or (prev is not None and (prev.dim() != 2 or prev.shape[1] != x.shape[1]
                                      or prev.dtype != x.dtype))):
        raise ValueError(f"logits {tuple(x.shape)}, bitmask {tuple(bits.shape)}, work "
                         f"{tuple(work.shape)} and out {tuple(out.shape)} do not fit")
    if bits.dtype != torch.int32 or work.dtype != torch.int32 or out.dtype != torch.int64:
        raise ValueError(f"want int32 words, int32 work and int64 out, got {bits.dtype}, "
                         f"{work.dtype}, {out.dtype}")
    if use_kernel is None:
        use_kernel = triton_usable(x, "masked_argmax")
    if not use_kernel:
        masked_argmax_ref(x, bits, work, out, prev)
        return
    num = work.shape[0]
    if not num:
        return
    prev = x if prev is None else prev
    if (x.stride(-1) != 1 or prev.stride(-1) != 1 or bits.stride(-1) != 1
            or not out.is_contiguous() or not work.is_contiguous()):
        raise ValueError("masked_argmax needs contiguous rows and tokens")
    chunks = -(-x.shape[1] // CHUNK)
    vals, cols, counts = _scratch(x.device, num, chunks)
    _kernel()[(num, chunks)](
        x, prev, bits, work, out, vals, cols, counts, x.stride(0), prev.stride(0), bits.stride(0),
        x.shape[1], bits.shape[1], CHUNK=CHUNK, NUM_CHUNKS=chunks,
        CP=max(16, 1 << (chunks - 1).bit_length()), ITEM=ITEM, num_warps=4)
