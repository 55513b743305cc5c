"""`token_logprob`: each row's raw logprob of one chosen token and its rank, packed [R, 2]
float32 (logprob, rank) as `pd.spec.graphs.pack_logprobs` packs a request with
top_logprobs 0, as Triton kernels with a torch twin. With `int_ranks` the pair is int32
(the logprob's float32 bits, the rank), for a host that reads ranks as integers. The ids may
come as groups of rows read in place ([G, g], any strides: an MTP step's accepted columns),
a negative id (no token there) reading column 0, and the pairs may go into a view of a larger
buffer (`out`), so a caller needs no kernel to gather the ids or place the pairs.

The rank is 1 + the number of columns whose logprob is strictly greater (`pd.engine.logprobs`).
The twin builds log_softmax of the whole [R, V] in float32 and compares it; the kernels cut
each row into segments (`split`: a few rows, as an MTP step's at batch 1, get many, so the
device is not left to a handful of programs walking 128k columns each; rows not cut go through
one kernel of one program per row) and walk each segment twice, in chunks of up to `CHUNK`
columns: first its max and sum of exponentials (online), then, with the row's max and sum from
every segment's, the count of its columns above the token, added atomically to the rank; each
logprob formed as log_softmax forms it ((x - max) - log(sum)). Nothing [R, V] is written. On the
current stream, capturable in a CUDA graph. `triton` is imported on first use; CPU machines run
the twin.
"""

from __future__ import annotations

import functools

import torch

from pd_kernels.triton_support import triton_usable

CHUNK = 4096  # columns per pass of one program
TARGET_PROGRAMS = 256  # programs per kernel the rows are cut for (a few per SM)
MAX_PARTS = 64  # segments of one row at most
MIN_SEGMENT = 1024  # columns of a segment at least


@functools.cache
def _kernels():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def max_sum(base, lo, hi, BLOCK: tl.constexpr):
        """The max and the sum of exponentials (online) of columns [lo, hi) of a row."""
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        return m, s

    @triton.jit
    def count_above(base, lo, hi, m, log_s, lp_tok, BLOCK: tl.constexpr):
        """How many columns of [lo, hi) have a logprob above `lp_tok`."""
        offs = tl.arange(0, BLOCK)
        above = tl.zeros((), tl.int32)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            above += tl.sum(((x - m) - log_s > lp_tok).to(tl.int32), 0)
        return above

    @triton.jit
    def token_id(ids_ptr, row, group, ids_sg, ids_sr):
        """Row `row`'s id: row (row % group) of group (row // group); a negative one reads 0."""
        return tl.maximum(tl.load(ids_ptr + (row // group) * ids_sg + (row % group) * ids_sr), 0)

    @triton.jit
    def pair_at(out_ptr, row, group, out_sg, out_sr):
        """Where row `row`'s pair goes."""
        return out_ptr + (row // group) * out_sg + (row % group) * out_sr

    # NOTE: triton's interpreter (CI's machines) runs a kernel with the module's globals
    globals().update(max_sum=max_sum, count_above=count_above, token_id=token_id, pair_at=pair_at)

    @triton.jit
    def whole_kernel(x_ptr, ids_ptr, out_ptr, stride_x, n_cols, group, ids_sg, ids_sr, out_sg,
                     out_sr, BLOCK: tl.constexpr, INT_RANKS: tl.constexpr):
        """Program row: both walks over the whole row (rows not cut: one kernel)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        m, s = max_sum(base, 0, n_cols, BLOCK)
        log_s = tl.log(s)
        tok = token_id(ids_ptr, row, group, ids_sg, ids_sr)
        lp_tok = (tl.load(base + tok).to(tl.float32) - m) - log_s
        above = count_above(base, 0, n_cols, m, log_s, lp_tok, BLOCK)
        pair = pair_at(out_ptr, row, group, out_sg, out_sr)
        if INT_RANKS:
            tl.store(pair, lp_tok.to(tl.int32, bitcast=True))
            tl.store(pair + 1, above + 1)
        else:
            tl.store(pair, lp_tok)
            tl.store(pair + 1, (above + 1).to(tl.float32))

    @triton.jit
    def partials_kernel(x_ptr, part_ptr, out_ptr, stride_x, n_cols, seg, n_parts, group, out_sg,
                        out_sr, BLOCK: tl.constexpr, INT_RANKS: tl.constexpr):
        """Program (row, p): the max and sum of its segment; p = 0 starts the row's rank at 1."""
        row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
        m, s = max_sum(x_ptr + row * stride_x, p * seg, tl.minimum(p * seg + seg, n_cols), BLOCK)
        tl.store(part_ptr + (row * n_parts + p) * 2, m)
        tl.store(part_ptr + (row * n_parts + p) * 2 + 1, s)
        if p == 0:
            pair = pair_at(out_ptr, row, group, out_sg, out_sr)
            if INT_RANKS:
                tl.store(pair + 1, 1)
            else:
                tl.store(pair + 1, 1.0)

    @triton.jit
    def ranks_kernel(x_ptr, ids_ptr, part_ptr, out_ptr, stride_x, n_cols, seg, n_parts, group,
                     ids_sg, ids_sr, out_sg, out_sr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                     INT_RANKS: tl.constexpr):
        """Program (row, p): the row's max and log-sum from its segments', the token's logprob
        (stored by p = 0), and its segment's columns above it, added to the rank."""
        row, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
        base = x_ptr + row * stride_x
        k = tl.arange(0, PARTS)
        pm = tl.load(part_ptr + (row * n_parts + k) * 2, mask=k < n_parts, other=float("-inf"))
        ps = tl.load(part_ptr + (row * n_parts + k) * 2 + 1, mask=k < n_parts, other=0.0)
        m = tl.max(pm, 0)
        log_s = tl.log(tl.sum(ps * tl.exp(pm - m), 0))
        tok = token_id(ids_ptr, row, group, ids_sg, ids_sr)
        lp_tok = (tl.load(base + tok).to(tl.float32) - m) - log_s
        above = count_above(base, p * seg, tl.minimum(p * seg + seg, n_cols), m, log_s, lp_tok,
                            BLOCK)
        pair = pair_at(out_ptr, row, group, out_sg, out_sr)
        if INT_RANKS:
            tl.atomic_add(pair + 1, above)
            if p == 0:
                tl.store(pair, lp_tok.to(tl.int32, bitcast=True))
        else:
            tl.atomic_add(pair + 1, above.to(tl.float32))
            if p == 0:
                tl.store(pair, lp_tok)

    return whole_kernel, partials_kernel, ranks_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split(rows: int, cols: int) -> tuple[int, int, int]:
    """(segment, parts, block): each row cut into `parts` segments of `segment` columns (a
    multiple of `block`), about `TARGET_PROGRAMS` programs in all, none under `MIN_SEGMENT`
    columns but a whole short row."""
    parts = max(1, min(MAX_PARTS, TARGET_PROGRAMS // rows, cols // MIN_SEGMENT))
    per = -(-cols // parts)
    block = min(CHUNK, max(16, _pow2(per)))
    seg = -(-per // block) * block
    return seg, -(-cols // seg), block


def token_logprob_ref(logits: torch.Tensor, ids: torch.Tensor,
                      int_ranks: bool = False) -> torch.Tensor:
    """The torch twin: [R, V] logits, [R] ids -> [R, 2] float32 (logprob, rank), or int32
    (logprob bits, rank) with `int_ranks`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = lp.gather(-1, ids.view(-1, 1))
    rank = (lp > tok).sum(dim=-1, keepdim=True) + 1
    if int_ranks:
        return torch.cat([tok.view(torch.int32), rank.int()], dim=1)
    return torch.cat([tok, rank.float()], dim=1)


def token_logprob(logits: torch.Tensor, ids: torch.Tensor, use_kernel: bool | None = None,
                  int_ranks: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's logprob of its id and its rank -> [R, 2] float32 (int32 with `int_ranks`:
    the logprob's bits, the rank): the kernel on CUDA, else the twin. `ids`: [R], or [G, g]
    with any strides (row r's id is ids[r // g, r % g]); a negative id (no token there) reads
    column 0, its pair meaningless. `out`: where the pairs go instead of a new tensor, shaped
    like `ids` with a last dimension of 2 (the pair's two contiguous), of the pairs' dtype (a
    view into a larger buffer); returned."""
    if logits.dim() != 2 or ids.dim() not in (1, 2) or ids.numel() != logits.shape[0]:
        raise ValueError(f"token_logprob takes logits [rows, columns] and one id per row, got "
                         f"{tuple(logits.shape)} and {tuple(ids.shape)}")
    dtype = torch.int32 if int_ranks else torch.float32
    if out is not None and (out.dtype != dtype or tuple(out.shape) != (*ids.shape, 2)
                            or out.stride(-1) != 1):
        raise ValueError(f"token_logprob's out must be {dtype} shaped {(*ids.shape, 2)} with "
                         f"each pair contiguous, got {out.dtype} {tuple(out.shape)}")
    if use_kernel is None:
        use_kernel = triton_usable(logits, "token_logprob") and logits.stride(-1) == 1
    if not use_kernel:
        pairs = token_logprob_ref(logits, ids.reshape(-1).clamp(min=0), int_ranks)
        if out is None:
            return pairs
        out.copy_(pairs.view(out.shape))
        return out
    if logits.stride(-1) != 1:
        raise ValueError("token_logprob needs contiguous rows")
    rows, cols = logits.shape
    if out is None:
        out = torch.empty(*ids.shape, 2, dtype=dtype, device=logits.device)
    groups = ids.to(torch.int64)  # int64 ids are read in place, strides and all
    pairs = out
    if groups.dim() == 1:
        groups, pairs = groups.unsqueeze(0), out.unsqueeze(0)
    group, (ids_sg, ids_sr), (out_sg, out_sr) = groups.shape[1], groups.stride(), pairs.stride()[:2]
    seg, parts, block = split(rows, cols)
    whole, partials, ranks = _kernels()
    warps = 8 if block >= 2048 else 4
    if parts == 1:
        whole[(rows,)](logits, groups, out, logits.stride(0), cols, group, ids_sg, ids_sr, out_sg,
                       out_sr, BLOCK=block, INT_RANKS=int_ranks, num_warps=warps)
        return out
    part = torch.empty(rows, parts, 2, dtype=torch.float32, device=logits.device)
    partials[(rows, parts)](logits, part, out, logits.stride(0), cols, seg, parts, group, out_sg,
                            out_sr, BLOCK=block, INT_RANKS=int_ranks, num_warps=warps)
    ranks[(rows, parts)](logits, groups, part, out, logits.stride(0), cols, seg, parts, group,
                         ids_sg, ids_sr, out_sg, out_sr, BLOCK=block, PARTS=_pow2(parts),
                         INT_RANKS=int_ranks, num_warps=warps)
    return out
