"""`paged_decode`: attention of one query token per sequence over its paged KV cache, as a
Triton kernel split along the sequence, with a torch twin.

Per sequence b with `context_lens[b]` = n cached tokens whose blocks are `block_tables[b]`:
out[b, h] = softmax(q[b, h] . K[b, :n, h // G]^T * scale) V[b, :n, h // G], G query heads per KV
head. The kernel runs one program per (sequence, KV head, split of the block table); each
program loads its split's keys and values as one tile (their block ids first, then every row at
once), takes the softmax of the G query heads of its KV head over them and writes an
unnormalized partial (accumulator, max, sum); a second small kernel merges the partials with a
log-sum-exp. Splitting the sequence keeps the
GPU busy for long contexts at small batch; the split is a fixed SPLIT_TOKENS keys, so a
sequence's output does not depend on the batch it is in (batch-invariant). Everything is on the current stream and capturable
in a CUDA graph (shapes depend only on the batch and the block-table width). Writing the step's
own K/V into the cache before the call is `kernels.rope_cache`'s job.

`triton` is imported on first use only; CPU machines run the twin.
"""

from __future__ import annotations

import functools
import os

import torch

SPLIT_TOKENS = 128  # keys per program: fixed, so a sequence's result is the same in any batch


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    # NOTE: the block-table stride varies with an eager step's context; unspecialized, so a
    # new length never waits for a compile
    @triton.jit(do_not_specialize=["stride_bt"])
    def decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, scale,
                      stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_bt,
                      stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                      G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                      TILE: tl.constexpr, SUB: tl.constexpr, STAGES: tl.constexpr,
                      IEEE: tl.constexpr):
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.load(lens_ptr + b)
        rows = tl.arange(0, GP)
        cols = tl.arange(0, D)
        row_ok = rows < G
        heads = h * G + rows
        first = s * TILE
        if first >= n:  # a split past the sequence's end: weight 0 in the merge
            tl.store(acc_ptr + b * stride_ab + heads[:, None] * stride_ah + s * stride_as
                     + cols[None, :], tl.zeros([GP, D], tl.float32), mask=row_ok[:, None])
            tl.store(m_ptr + b * stride_mb + heads * stride_mh + s, float("-inf"), mask=row_ok)
            tl.store(l_ptr + b * stride_mb + heads * stride_mh + s, 0.0, mask=row_ok)
            return
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        # NOTE: the split's keys in sub-tiles of SUB (SUB == TILE: the whole split as one tile),
        # each loaded at once (its block ids, then every key and value row of it): a walk block
        # by block waits on one dependent load after another
        for j in tl.range(0, TILE, SUB, num_stages=STAGES):
            toks = first + j + tl.arange(0, SUB)
            ok = toks < n
            phys = tl.load(bt_ptr + b * stride_bt + toks // BLOCK, mask=ok, other=0).to(tl.int64)
            offs = (phys * stride_kn + (toks % BLOCK) * stride_kt + h * stride_kh)[:, None] \
                + cols[None, :]
            k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)  # [SUB, D]
            v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale  # [GP, SUB]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            # NOTE: the first sub-tile holds a key (first < n), so m_new is finite from it on
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(acc_ptr + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + cols[None, :],
                 acc, mask=row_ok[:, None])
        tl.store(m_ptr + b * stride_mb + heads * stride_mh + s, m_i, mask=row_ok)
        tl.store(l_ptr + b * stride_mb + heads * stride_mh + s, l_i, mask=row_ok)

    return decode_kernel


@functools.cache
def _merge_kernel():
    import triton  # noqa: PLC0415
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_splits"])
    def merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ab, stride_ah, stride_as,
                     stride_mb, stride_mh, stride_ob, stride_oh, num_splits,
                     CH: tl.constexpr, D: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        chunk = tl.arange(0, CH)
        cols = tl.arange(0, D)
        m_base = m_ptr + b * stride_mb + h * stride_mh
        top = tl.max(tl.full([CH], float("-inf"), tl.float32), 0)
        for c in range(0, num_splits, CH):
            top = tl.maximum(top, tl.max(tl.load(m_base + c + chunk, mask=c + chunk < num_splits,
                                                 other=float("-inf")), 0))
        acc = tl.zeros([D], tl.float32)
        total = tl.sum(tl.zeros([CH], tl.float32), 0)
        for c in range(0, num_splits, CH):
            ok = c + chunk < num_splits
            # splits past a sequence's end hold m = -inf and l = 0: weight 0
            w = tl.where(ok, tl.exp(tl.load(m_base + c + chunk, mask=ok, other=float("-inf")) - top), 0.0)
            part = tl.load(l_ptr + b * stride_mb + h * stride_mh + c + chunk, mask=ok, other=0.0)
            total += tl.sum(part * w, 0)
            a = tl.load(acc_ptr + b * stride_ab + h * stride_ah + (c + chunk)[:, None] * stride_as
                        + cols[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(a * w[:, None], 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + cols, (acc / total).to(out_ptr.dtype.element_ty))

    return merge_kernel


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
                 sub_tokens: int | None = None, stages: int = 1) -> torch.Tensor:
    """Decode attention (see the module docstring); the kernel on CUDA, else the twin.
    Every sequence must have context_lens >= 1 and block_tables wide enough for it.
    For the benchmark's sweep: `num_warps` overrides the warps per program, `sub_tokens` (a
    power of two, 16 up to the split) the keys loaded at once, `stages` the software
    pipelining of those loads. Each choice is one fixed order of work, so each is
    batch-invariant; they differ from each other in rounding."""
    if use_kernel is None:
        use_kernel = can_use_kernel(q, k_cache)
    if not use_kernel:
        return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block, kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape or num_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match {num_seqs} sequences")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches need a contiguous last dimension and equal cache strides")
    if sub_tokens is not None and (sub_tokens < 16 or sub_tokens & (sub_tokens - 1)
                                   or sub_tokens > max(1, SPLIT_TOKENS // block) * block):
        raise ValueError(f"sub_tokens={sub_tokens}: a power of two from 16 up to the split")
    block_tables = block_tables.contiguous()
    group = num_heads // kv_heads
    width = block_tables.shape[1]
    # NOTE: the split is a fixed number of blocks, never a function of the batch or of the
    # table's width: a sequence's keys are then reduced in the same order in every batch (a
    # plain step of B sequences and an MTP verify step of B * (k + 1) rows give bit-equal
    # rows), and splits past its end add exact zeros in the merge
    per_split = max(1, SPLIT_TOKENS // block)
    splits = -(-width // per_split)
    acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    _kernel()[(num_seqs, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, s, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        G=group, GP=max(16, 1 << (group - 1).bit_length()), BLOCK=block, D=head_dim,
        TILE=per_split * block, SUB=sub_tokens or per_split * block, STAGES=stages,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps or (4 if per_split * block * head_dim <= 8192 else 8))
    # merge the splits (log-sum-exp): splits past a sequence's end hold m = -inf and l = 0
    # NOTE: CH is fixed: a chunk sized to the table's width would sum in another order
    # (float32 outputs would then differ with the width)
    out = torch.empty_like(q)
    _merge_kernel()[(num_seqs, num_heads)](
        acc, m, s, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), splits, CH=32, D=head_dim)
    return out
