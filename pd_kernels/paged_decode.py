"""`paged_decode`: attention of one query token per sequence over its paged KV cache, as a
Triton kernel split along the sequence, with a torch twin.

Per sequence b with `context_lens[b]` = n cached tokens whose blocks are `block_tables[b]`:
out[b, h] = softmax(q[b, h] . K[b, :n, h // G]^T * scale) V[b, :n, h // G], G query heads per KV
head. A sequence's keys are cut in splits of a fixed SPLIT_TOKENS keys; each split's keys and
values are loaded as one tile (their block ids first, then every row at once) and give an
unnormalized partial softmax (max, sum, accumulator) of the G query heads of its KV head; the
partials are folded one by one in split order into the output. Two ways to run it, with the
same arithmetic (so the same bits):
- one program per (sequence, KV head, split), at small batch, where splitting keeps the GPU
  busy: a sequence held by one split is written out by its program; otherwise each program
  writes its partial and counts itself done on a per-(sequence, KV head) counter, and the last
  one folds the partials (one launch per call, no merge kernel);
- one program per (sequence, KV head) (`whole`, from `WHOLE_PROGRAMS` programs per
  multiprocessor), at large batch, where there are programs enough: it walks the splits,
  the next one's loads in flight while it folds the last, and writes nothing but the output.
A sequence's KV heads run in neighbouring programs (`HEADS_FIRST`): their keys and values share
each token's row of the cache, read at about the same time (3-4% faster at batch 64 and up on an
H100 than a KV head's sequences side by side; the launch order changes no bit).
The split never depends on the batch, so a sequence's output does not depend on the batch it is
in (batch-invariant). Everything is on the current stream and capturable
in a CUDA graph (shapes depend only on the batch and the block-table width). Writing the step's
own K/V into the cache before the call is `pd_kernels.rope_cache`'s job, except in a plain decode
step, where the kernel rotates q and k and writes them itself (`rope`).

`triton` is imported on first use only; CPU machines run the twin.
"""

from __future__ import annotations

import functools
import os

import torch

from pd_kernels.rope_cache import rope_and_cache_ref
from pd_kernels.triton_support import pdl_options

SPLIT_TOKENS = 128  # keys per program: fixed, so a sequence's result is the same in any batch


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: PLC0415

    @triton.jit
    def _tile(q, k_ptr, v_ptr, bt_row, n, toks, h, scale, stride_kn, stride_kt, stride_kh,
              m_i, l_i, acc, BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
        """The online softmax (m_i, l_i, acc) of the G query rows of q over the keys `toks`
        (those below n), loaded at once: their block ids, then every key and value row."""
        cols = tl.arange(0, D)
        ok = toks < n
        phys = tl.load(bt_row + toks // BLOCK, mask=ok, other=0).to(tl.int64)
        offs = (phys * stride_kn + (toks % BLOCK) * stride_kt + h * stride_kh)[:, None] + cols[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)  # [SUB, D]
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [GP, SUB]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        # NOTE: a split's first tile holds a key (first < n), so m_new is finite from it on
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _merge(top, total, merged, m, l, acc):
        """Fold one split's partial (m, l, acc) into the running (top, total, merged): splits
        are folded one by one in their order, in memory or in registers alike."""
        new = tl.maximum(top, m)
        a = tl.exp(top - new)
        b = tl.exp(m - new)
        return new, total * a + l * b, merged * a[:, None] + acc * b[:, None]

    @triton.jit
    def _rotated(ptr, offs, row_ok, cos_row, sin_row, D: tl.constexpr):
        """Rows of x at ptr + offs (+ column) rotated (rotate-half RoPE by the cos/sin row of
        their token), rounded step by step as `pd_kernels.rope_cache` rounds them."""
        cols = tl.arange(0, D)
        partner = (cols + D // 2) % D
        x = tl.load(ptr + offs[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
        xp = tl.load(ptr + offs[:, None] + partner[None, :], mask=row_ok[:, None], other=0.0)
        dt = x.dtype
        c = tl.load(cos_row + cols).to(tl.float32)[None, :]
        sn = tl.load(sin_row + cols).to(tl.float32)[None, :]
        sign = tl.where(cols < D // 2, -1.0, 1.0)[None, :]
        return ((x.to(tl.float32) * c).to(dt).to(tl.float32)
                + (sign * xp.to(tl.float32) * sn).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _write_new(kn_ptr, vn_ptr, cos_row, sin_row, k_ptr, v_ptr, slot, h, stride_kn,
                   stride_kt, stride_kh, BLOCK: tl.constexpr, D: tl.constexpr):
        """The step's own key (rotated) and value of KV head h into the cache at `slot`; then a
        barrier, so this program's loads of the slot see them."""
        one = tl.arange(0, 1)
        cols = tl.arange(0, D)
        k = _rotated(kn_ptr, one * 0, one == 0, cos_row, sin_row, D)  # [1, D]
        v = tl.load(vn_ptr + cols)
        dst = (slot // BLOCK).to(tl.int64) * stride_kn + (slot % BLOCK) * stride_kt + h * stride_kh
        tl.store(k_ptr + dst + one[:, None] * 0 + cols[None, :], k.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + dst + cols, v.to(v_ptr.dtype.element_ty))
        tl.debug_barrier()

    # NOTE: triton's interpreter (CI's machines) runs the kernel with the module's globals
    # alone, not this function's locals: the helpers go there too
    globals().update(_tile=_tile, _merge=_merge, _rotated=_rotated, _write_new=_write_new)

    # NOTE: the block-table stride varies with an eager step's context; unspecialized, so a
    # new length never waits for a compile
    @triton.jit(do_not_specialize=["stride_bt"])
    def decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, count_ptr,
                      out_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, index_ptr, slot_ptr, scale,
                      table_rows, stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_bt,
                      stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
                      stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb,
                      G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                      TILE: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr,
                      IEEE: tl.constexpr, WHOLE: tl.constexpr, ROPE: tl.constexpr,
                      HAS_INDEX: tl.constexpr, HEADS_FIRST: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see pd_kernels.triton_support.pdl_options
            gdc_wait()
            gdc_launch_dependents()
        if HEADS_FIRST:  # a sequence's KV heads in neighbouring programs
            h, b, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
            kv_heads = tl.num_programs(0)
        else:
            b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
            kv_heads = tl.num_programs(1)
        n = tl.load(lens_ptr + b)
        rows = tl.arange(0, GP)
        cols = tl.arange(0, D)
        row_ok = rows < G
        heads = h * G + rows
        if ROPE:  # q, k, v as the projection left them: rotary and the cache write here
            c = tl.load(index_ptr + b).to(tl.int64) if HAS_INDEX else b  # its table row
            cos_row, sin_row = cos_ptr + c * stride_cb, sin_ptr + c * stride_cb
            q = _rotated(q_ptr + b * stride_qb, heads * stride_qh, row_ok, cos_row, sin_row, D)
            slot = tl.load(slot_ptr + b)
            # NOTE: the program whose split holds the step's own token (the last) writes it,
            # and only it reads it
            if slot >= 0 and (WHOLE or s == (n - 1) // TILE):
                _write_new(kn_ptr + b * stride_knb + h * stride_knh, vn_ptr + b * stride_vnb
                           + h * stride_vnh, cos_row, sin_row, k_ptr, v_ptr, slot, h, stride_kn,
                           stride_kt, stride_kh, BLOCK, D)
        else:
            q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                        mask=row_ok[:, None], other=0.0)
        bt_row = bt_ptr + (b // table_rows) * stride_bt  # its sequence's table
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + cols[None, :]
        splits = tl.cdiv(n, TILE)
        top = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        merged = tl.zeros([GP, D], tl.float32)
        if WHOLE:  # this program takes every split of the sequence, folding each in turn
            if SUB == TILE:  # one tile per split: the loop over splits is software-pipelined
                for s2 in tl.range(0, splits, num_stages=STAGES):
                    m_i, l_i, acc = _tile(
                        q, k_ptr, v_ptr, bt_row, n, s2 * TILE + tl.arange(0, SUB), h, scale,
                        stride_kn, stride_kt, stride_kh, tl.full([GP], float("-inf"), tl.float32),
                        tl.zeros([GP], tl.float32), tl.zeros([GP, D], tl.float32), BLOCK, D, IEEE)
                    top, total, merged = _merge(top, total, merged, m_i, l_i, acc)
            else:
                for s2 in range(0, splits):
                    m_i = tl.full([GP], float("-inf"), tl.float32)
                    l_i = tl.zeros([GP], tl.float32)
                    acc = tl.zeros([GP, D], tl.float32)
                    for j in tl.range(0, TILE, SUB, num_stages=STAGES):
                        m_i, l_i, acc = _tile(q, k_ptr, v_ptr, bt_row, n,
                                              s2 * TILE + j + tl.arange(0, SUB), h, scale,
                                              stride_kn, stride_kt, stride_kh, m_i, l_i, acc,
                                              BLOCK, D, IEEE)
                    top, total, merged = _merge(top, total, merged, m_i, l_i, acc)
            tl.store(out, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            return
        first = s * TILE
        if first >= n:  # a split past the sequence's end: no work, not counted
            return
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        # NOTE: the split's keys in sub-tiles of SUB (SUB == TILE: the whole split as one tile),
        # each loaded at once: a walk block by block waits on one dependent load after another
        for j in tl.range(0, TILE, SUB, num_stages=STAGES):
            m_i, l_i, acc = _tile(q, k_ptr, v_ptr, bt_row, n, first + j + tl.arange(0, SUB), h,
                                  scale, stride_kn, stride_kt, stride_kh, m_i, l_i, acc, BLOCK, D,
                                  IEEE)
        if splits == 1:  # the whole sequence in this program
            top, total, merged = _merge(top, total, merged, m_i, l_i, acc)
            tl.store(out, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            return
        part = b * stride_mb + heads * stride_mh
        parts = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + cols[None, :]
        tl.store(parts + s * stride_as, acc, mask=row_ok[:, None])
        tl.store(m_ptr + part + s, m_i, mask=row_ok)
        tl.store(l_ptr + part + s, l_i, mask=row_ok)
        # NOTE: the last of the sequence's splits to finish merges them all. Every thread's
        # stores above are done (barrier) before the release of the count; the last one's
        # acquire makes the other programs' partials visible to its loads (which bypass L1).
        # It resets the count for the next launch. Whichever program is last, the merge is the
        # same arithmetic over the same partials in split order, the arithmetic of WHOLE:
        # batch-invariant
        tl.debug_barrier()
        counter = count_ptr + b * kv_heads + h
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            tl.atomic_xchg(counter, 0)
            for s2 in tl.range(0, splits, num_stages=3):
                m_s = tl.load(m_ptr + part + s2, mask=row_ok, other=0.0, cache_modifier=".cg")
                l_s = tl.load(l_ptr + part + s2, mask=row_ok, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(parts + s2 * stride_as, mask=row_ok[:, None], other=0.0,
                                cache_modifier=".cg")
                top, total, merged = _merge(top, total, merged, m_s, l_s, acc_s)
            tl.store(out, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return decode_kernel


WHOLE_PROGRAMS = 1  # programs per multiprocessor from which `whole` is the default
WHOLE_STAGES = 2  # splits in flight in a `whole` program
HEADS_FIRST = True  # launch order: a sequence's KV heads in neighbouring programs (3-4% faster)

_COUNTS: dict[torch.device, torch.Tensor] = {}


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _counts(device: torch.device, size: int) -> torch.Tensor:
    """The split counters of `device` (int32 zeros; every launch leaves them zero again),
    made on first use, before a graph captures the kernel (its warm-up run). One decode
    attention runs at a time per device: the counters are shared by its launches."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < size:
        counts = _COUNTS[device] = torch.zeros(max(size, 1 << 16), dtype=torch.int32, device=device)
    return counts


def can_use_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CUDA, triton importable, a block size and head dim `tl.dot` takes, unless
    `PD_ATTENTION=torch` asks for the torch path."""
    if not q.is_cuda or os.environ.get("PD_ATTENTION", "triton") == "torch":
        return False
    block, head_dim = k_cache.shape[1], k_cache.shape[3]
    if block < 16 or block & (block - 1) or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        _kernel()
    except Exception:  # ImportError, or a triton that cannot compile here
        return False
    return True


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch twin, in float32: q [B, Hq, D], caches [blocks, block_size, Hkv, D],
    block_tables [B, W] int, context_lens [B] int -> [B, Hq, D] in q's dtype."""
    num_seqs, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    keys = k_cache[block_tables.long()].flatten(1, 2).float()  # [B, W * block_size, Hkv, D]
    values = v_cache[block_tables.long()].flatten(1, 2).float()
    keys = keys.repeat_interleave(group, dim=2)  # [B, T, Hq, D]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), keys) * scale
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bht,bthd->bhd", scores.softmax(-1), values).to(q.dtype)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 use_kernel: bool | None = None, num_warps: int | None = None,
                 sub_tokens: int | None = None, stages: int | None = None,
                 split_tokens: int = SPLIT_TOKENS, whole: bool | None = None,
                 rope: tuple | None = None, table_rows: int = 1,
                 heads_first: bool | None = None) -> torch.Tensor:
    """Decode attention (see the module docstring); the kernel on CUDA, else the twin.
    Every sequence must have context_lens >= 1 and block_tables wide enough for it.
    `rope` = (k, v, cos, sin, slot_mapping), one row per sequence (a plain decode step, where no
    row reads another row's new key): q, k and v are the projection's, unrotated; the kernel
    rotates q and k (as `pd_kernels.rope_cache` does, to the bit) and writes k and v to the cache
    at each row's slot (none where it is negative) before it reads them: one kernel for what
    was two. `rope` may carry a sixth element, each row's index into cos and sin [P, D] (the
    rotary position cache: the gather is the kernel's). `table_rows`: each table of
    `block_tables` serves that many consecutive rows (an MTP verify step's k + 1 rows of one
    sequence), read in place.
    For the benchmark's sweep: `num_warps` overrides the warps per program, `sub_tokens` (a
    power of two, 16 up to the split) the keys loaded at once, `stages` the software
    pipelining of those loads (of the splits, with `whole` and a split loaded at once; 1, or
    WHOLE_STAGES with `whole`),
    `split_tokens` the keys per split, `whole` one program per sequence and KV head (the
    default from `WHOLE_PROGRAMS`), `heads_first` the launch order (default `HEADS_FIRST`).
    Each choice of the others is one fixed order of work, so each is batch-invariant; they
    differ from each other in rounding. `whole` and `heads_first` do not change the result: a
    sequence's splits are folded in the same order either way."""
    if use_kernel is None:
        use_kernel = can_use_kernel(q, k_cache)
    if not use_kernel:
        if rope is not None:
            k, v, cos, sin, slots, *index = rope
            q = rope_and_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slots,
                                   torch.nonzero(slots >= 0).flatten(), *index)
        if table_rows > 1:
            block_tables = block_tables.repeat_interleave(table_rows, 0)
        return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block, kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape or num_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if block_tables.shape[0] * table_rows != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match {num_seqs} sequences")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches need a contiguous last dimension and equal cache strides")
    if sub_tokens is not None and (sub_tokens < 16 or sub_tokens & (sub_tokens - 1)
                                   or sub_tokens > max(1, split_tokens // block) * block):
        raise ValueError(f"sub_tokens={sub_tokens}: a power of two from 16 up to the split")
    block_tables = block_tables.contiguous()
    group = num_heads // kv_heads
    width = block_tables.shape[1]
    # NOTE: the split is a fixed number of blocks, never a function of the batch or of the
    # table's width: a sequence's keys are then reduced in the same order in every batch (a
    # plain step of B sequences and an MTP verify step of B * (k + 1) rows give bit-equal
    # rows); splits past its end do nothing
    per_split = max(1, split_tokens // block)
    splits = -(-width // per_split)
    if whole is None:
        whole = num_seqs * kv_heads >= WHOLE_PROGRAMS * _multiprocessors(q.device)
    if stages is None:
        stages = WHOLE_STAGES if whole else 1
    if whole:  # no partials: nothing is written to them
        acc = m = s = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    else:
        acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        s = torch.empty_like(m)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    index = None
    if rope is not None:
        k, v, cos, sin, slots, *index = rope
        index = index[0] if index else None
        if (k.shape != (num_seqs, kv_heads, head_dim) or v.shape != k.shape
                or cos.shape != (num_seqs if index is None else cos.shape[0], head_dim)
                or (index is not None and index.shape != (num_seqs,))
                or sin.stride() != cos.stride()
                or slots.shape != (num_seqs,) or k.stride(2) != 1 or v.stride(2) != 1
                or cos.stride(1) != 1 or head_dim % 2):
            raise ValueError(f"rope: k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                             f"{tuple(cos.shape)}, slots {tuple(slots.shape)} do not fit q "
                             f"{tuple(q.shape)}")
    else:
        k = v = cos = sin = slots = q  # unread
    if heads_first is None:
        heads_first = HEADS_FIRST
    grid = (kv_heads, num_seqs) if heads_first else (num_seqs, kv_heads)
    _kernel()[(*grid, 1 if whole else splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, s,
        _counts(q.device, num_seqs * kv_heads), out, k, v, cos, sin,
        index if index is not None else slots, slots, scale, table_rows,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        G=group, GP=max(16, 1 << (group - 1).bit_length()), BLOCK=block, D=head_dim,
        TILE=per_split * block, SUB=sub_tokens or per_split * block, STAGES=stages,
        IEEE=q.dtype == torch.float32, WHOLE=whole, ROPE=rope is not None,
        HAS_INDEX=index is not None, HEADS_FIRST=heads_first,
        num_warps=num_warps or (4 if per_split * block * head_dim <= 8192 else 8),
        enable_fp_fusion=False,  # NOTE: no fma, so the fold rounds alike in memory and registers
        **pdl_options(q))
    return out
