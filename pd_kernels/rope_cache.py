"""`rope_and_cache`: rotary embedding of a step's queries and keys, fused with writing the keys
and values into the paged KV cache, as one Triton kernel with a torch twin.

q [T, Hq, D], k and v [T, Hkv, D] (strided views of the QKV projection are fine), cos and sin
[T, D] in q's dtype (the rotary tables of this forward, `pd.model.layers.RotaryEmbedding`), or
tables [P, D] and each token's row in them (the position cache and the positions: the gather
is the kernel's).
Non-interleaved (rotate-half) RoPE: out = x * cos + cat(-x2, x1) * sin, each product rounded to
the dtype before the sum as the torch reference does. Rotated q is returned; rotated k and v go
to cache slot `slot_mapping[t]` (caches [num_blocks, block_size, Hkv, D]; a negative slot is
not written). One program per token, over all its heads (a program per (token, head) was 10x
slower than the bandwidth at prefill sizes); on the current stream, capturable in a CUDA graph.
`triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch

from pd_kernels.triton_support import pdl_options, triton_usable


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: PLC0415

    @triton.jit
    def _rotate(base, stride_h, heads, c1, c2, s1, s2, offs, HALF: tl.constexpr,
                H_P2: tl.constexpr):
        """Rows 0..heads-1 of [H_P2, HALF] tiles at base + h * stride_h (padding rows masked)."""
        h = tl.arange(0, H_P2)[:, None]
        mask = (h < heads) & (offs[None, :] < HALF)
        ptr = base + h * stride_h + offs[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2, h, mask

    @triton.jit
    def rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, index_ptr, slot_ptr, qo_ptr,
                          kc_ptr, vc_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, stride_ct, stride_ot, stride_oh, stride_cs, stride_ch,
                          HQ: tl.constexpr, HKV: tl.constexpr, HQ_P2: tl.constexpr,
                          HKV_P2: tl.constexpr, HALF: tl.constexpr, HAS_INDEX: tl.constexpr,
                          PDL: tl.constexpr):
        if PDL:  # see pd_kernels.triton_support.pdl_options
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, HALF)
        c = tl.load(index_ptr + t).to(tl.int64) if HAS_INDEX else t  # the token's table row
        c1 = tl.load(cos_ptr + c * stride_ct + offs).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + c * stride_ct + HALF + offs).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + c * stride_ct + offs).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + c * stride_ct + HALF + offs).to(tl.float32)[None, :]
        o1, o2, h, mask = _rotate(q_ptr + t * stride_qt, stride_qh, HQ, c1, c2, s1, s2, offs,
                                  HALF, HQ_P2)
        out = qo_ptr + t * stride_ot + h * stride_oh + offs[None, :]
        tl.store(out, o1, mask=mask)
        tl.store(out + HALF, o2, mask=mask)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            # NOTE: new names: triton refuses a variable that changes shape inside an if
            k1, k2, hk, kmask = _rotate(k_ptr + t * stride_kt, stride_kh, HKV, c1, c2, s1, s2,
                                        offs, HALF, HKV_P2)
            dst = slot * stride_cs + hk * stride_ch + offs[None, :]
            tl.store(kc_ptr + dst, k1.to(kc_ptr.dtype.element_ty), mask=kmask)
            tl.store(kc_ptr + dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=kmask)
            vsrc = v_ptr + t * stride_vt + hk * stride_vh + offs[None, :]
            tl.store(vc_ptr + dst, tl.load(vsrc, mask=kmask).to(vc_ptr.dtype.element_ty), mask=kmask)
            tl.store(vc_ptr + dst + HALF,
                     tl.load(vsrc + HALF, mask=kmask).to(vc_ptr.dtype.element_ty), mask=kmask)

    return rope_cache_kernel


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D]: rotate-half RoPE in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_and_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                       write_index: torch.Tensor | None = None,
                       cos_index: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin. `write_index` (the tokens whose slot is not negative, or None for all)
    lets the caller skip the negative slots without a device-to-host sync."""
    if cos_index is not None:
        cos, sin = cos[cos_index], sin[cos_index]
    q, k = rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)
    slots = slot_mapping
    if write_index is not None:
        slots, k, v = slots[write_index], k[write_index], v[write_index]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
    return q


def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                   write_index: torch.Tensor | None = None, use_kernel: bool | None = None,
                   cos_index: torch.Tensor | None = None):
    """See the module docstring: the kernel on CUDA, else the twin. Returns rotated q. With
    `cos_index` [T] (int64), cos and sin are tables [P, D] and token t's rows are
    `cos_index[t]` (the gather is the kernel's)."""
    if use_kernel is None:
        use_kernel = triton_usable(q, "rope_cache")
    if not use_kernel:
        return rope_and_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_index,
                                  cos_index)
    tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    cos_rows = tokens if cos_index is None else cos.shape[0]
    if (cos.shape != (cos_rows, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride()
            or (cos_index is not None and cos_index.shape != (tokens,))):
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [{tokens}, {head_dim}] (or a table "
                         f"with an index of {tokens} rows), alike")
    if k_cache.shape[2:] != (kv_heads, head_dim) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit k {tuple(k.shape)}")
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim {head_dim}: the kernel needs half of it to be a power of two")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, k_cache)) or slot_mapping.shape != (tokens,):
        raise ValueError("q, k, v, cos and the caches need a contiguous last dimension")
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    p2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    _kernel()[(tokens,)](
        q, k, v, cos, sin, cos_index if cos_index is not None else slot_mapping, slot_mapping,
        out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        HQ=num_heads, HKV=kv_heads, HQ_P2=p2(num_heads), HKV_P2=p2(kv_heads), HALF=head_dim // 2,
        HAS_INDEX=cos_index is not None, num_warps=4 if num_heads * head_dim >= 1024 else 1,
        enable_fp_fusion=False, **pdl_options(q))  # NOTE: no fma, so each product rounds as in the twin
    return out
