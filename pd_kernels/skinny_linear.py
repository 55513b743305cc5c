"""`skinny_linear`: y = x W^T (+ b) for a few rows of x (a decode step of up to `MAX_ROWS`
sequences), as one Triton kernel with a torch twin.

At such a batch a linear layer is a stream of its weight matrix; for the 1B shape's layers
cuBLAS picks kernels that read the weights at 45-95% of the copy bandwidth. Here each program
owns `BN` output columns and one of `SPLITS` equal slices of the K dimension, and streams that
slice of its weight rows in `BK` steps, software-pipelined `STAGES` deep; the rows of x are
padded to 16, 32 or 64 (`BM`) for one tensor-core dot per step. With several slices, each
program writes its float32 partial and counts itself done on a per-column-tile counter; the
last one adds the partials in slice order and writes the tile (one launch, no reduction
kernel). Each output row is computed alone, in the same order whatever the number of rows of
its `BM` bucket: a sequence's result does not depend on the batch it is in, within a bucket.

Launched with programmatic dependent launch where there is one (`triton_support.pdl_options`):
a program first asks L2 for the first two steps of its weight rows, which depend on nothing,
then waits for the kernel before it (the norm that computes x), so the weight stream starts
while that kernel finishes.

`gated=True` (a gated MLP's gate/up weight, gate rows then up rows): each program streams the
same columns of gate and of up and writes silu(gate) * up, rounded as `silu_and_mul` rounds, in
place of the [M, 2I] product: the activation kernel goes (one launch per layer fewer; at batch 1
of the 1B shape 1.21 ms a step against 1.28, `bench_decode.py` with `PD_SILU_EPILOGUE=1 / 0`).
Under programmatic dependent launch this kernel lets the next one (the down projection) start
only after its weight stream, not at its start as the others do: started at its start, the step
was 0.06 ms slower than with two kernels (the down projection's waiting programs, resident
early, presumably holding the shared memory this one's programs needed).

The kernel can also read x through a prologue in place of the norm kernel before the product
(RMSNorm after the residual add): `pd_kernels.norm_linear` runs it.

Used for 16-bit weights where `config_for` has a measured configuration (`SHAPES`, from
`benchmarks/gpu/bench_skinny.py`); everywhere else cuBLAS. On the current stream, capturable in
a CUDA graph. `triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pd_kernels.activation import silu_and_mul
from pd_kernels.triton_support import pdl_options, triton_usable

MAX_ROWS = 64  # rows of x one program multiplies at most (the largest BM)


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: PLC0415

    @triton.jit
    def load_x(x_ptr, r_ptr, g_ptr, src, rm_ok, k_idx, k_ok, stride_xm, stride_rm, rstd,
               NORM: tl.constexpr, HAS_RES: tl.constexpr):
        """A [BM, BK] tile of the product's input at columns `k_idx`: x's rows (`src`), after
        the prologue (the residual add, the norm with row scale `rstd`), rounded as
        `pd_kernels.rms_norm` rounds."""
        ok = rm_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + src[:, None] * stride_xm + k_idx[None, :], mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + src[:, None] * stride_rm + k_idx[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if NORM:
            gw = tl.load(g_ptr + k_idx, mask=k_ok, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (normed * gw[None, :]).to(x.dtype)
        return x

    # NOTE: as in pd_kernels.paged_decode: triton's interpreter runs the kernel with the module's
    # globals alone
    globals().update(load_x=load_x)

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, r_ptr, g_ptr, h_ptr,
                      rows_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, stride_hm,
                      eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                      HAS_ROWS: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr):
        tile, s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = tile * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        row_ok = rm < M
        col_ok = rn < N
        if SPLITS == 1:
            k_lo = 0
            k_hi = K
        else:
            span = tl.cdiv(tl.cdiv(K, SPLITS), BK) * BK  # each slice a whole number of BK steps
            k_lo = s * span
            k_hi = tl.minimum(K, k_lo + span)
        w_base = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        # GATED: N is the output's width, the weight's rows gate (the first N) then up; the
        # program's columns of both, silu(gate) * up written
        u_base = w_base + N * stride_wn
        if PDL:  # see pd_kernels.triton_support.pdl_options
            # the first two steps of the slice into L2, one 128-byte line per request (the
            # weights are 16-bit: 64 per line), rows and columns clamped inside the matrix
            lines = tl.minimum(k_lo + tl.arange(0, 2 * BK // 64) * 64, K - 1)
            first = (w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
                     + lines[None, :])
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                      "=r,l", [first], dtype=tl.int32, is_pure=False, pack=1)
            if GATED:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                          "=r,l", [first + N * stride_wn], dtype=tl.int32,
                                          is_pure=False, pack=1)
            gdc_wait()
            if not GATED:
                gdc_launch_dependents()
        if HAS_ROWS:
            src = tl.load(rows_ptr + rm, mask=row_ok, other=0).to(tl.int64)
        else:
            src = rm.to(tl.int64)
        rstd = tl.zeros([BM], tl.float32)
        if NORM:
            # the rows' statistics over all of K (every program, whatever its slice); the first
            # program writes the residual stream after the add (or the gathered rows)
            ss = tl.zeros([BM], tl.float32)
            for k0 in range(0, K, BK):
                k_ok = (k0 + rk) < K
                x = load_x(x_ptr, r_ptr, g_ptr, src, row_ok, k0 + rk, k_ok, stride_xm,
                           stride_rm, rstd, False, HAS_RES)
                if HAS_RES or HAS_ROWS:
                    if (tile == 0) & (s == 0):
                        tl.store(h_ptr + rm[:, None].to(tl.int64) * stride_hm + (k0 + rk)[None, :],
                                 x, mask=row_ok[:, None] & k_ok[None, :])
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, 1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
            k_ok = (k0 + rk) < k_hi
            x = load_x(x_ptr, r_ptr, g_ptr, src, row_ok, k0 + rk, k_ok, stride_xm, stride_rm,
                       rstd, NORM, HAS_RES)
            w_ok = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_base + (k0 + rk)[None, :], mask=w_ok, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
            if GATED:
                u = tl.load(u_base + (k0 + rk)[None, :], mask=w_ok, other=0.0)
                acc_up = tl.dot(x, tl.trans(u), acc_up)
        y = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if PDL and GATED:
            # NOTE: the next kernel (the down projection) starts once these have streamed their
            # weights, not alongside them: let in at the start, the step at batch 1 was 0.06 ms
            # slower than with SiLU as its own kernel (its waiting programs, resident early,
            # presumably holding the shared memory these needed; see the module's docstring)
            gdc_launch_dependents()
        if GATED:  # SPLITS == 1; each half rounded as the product is, then as silu_and_mul rounds
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                acc_up += tl.load(b_ptr + N + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y, (silu * up).to(y_ptr.dtype.element_ty), mask=ok)
            return
        if SPLITS == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)
            return
        # part [SPLITS, BM, N] float32
        part = part_ptr + (rm[:, None].to(tl.int64) * N + rn[None, :])
        tl.store(part + s * BM * N, acc, mask=ok)
        # NOTE: as in pd_kernels.paged_decode: every thread's partial is stored (barrier) before
        # the release of the count; the last program's acquire makes the others' partials
        # visible to its loads (which bypass L1). It resets the count for the next launch and
        # adds the slices in their order, whichever program is last
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            tl.atomic_xchg(count_ptr + tile, 0)
            total = tl.zeros([BM, BN], tl.float32)
            for i in range(SPLITS):
                total += tl.load(part + i * BM * N, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y, total.to(y_ptr.dtype.element_ty), mask=ok)

    return skinny_kernel


# (N, K, BM) of a weight and a row bucket -> (BN, BK, SPLITS, STAGES, warps): where the kernel
# measured faster than cuBLAS on an H100, alone (`benchmarks/gpu/bench_skinny.py`, the speedup
# beside each) and in the 1B shape's decode step (`bench_decode.py`); any other shape keeps
# cuBLAS. PD_SKINNY=0 turns the kernel off, PD_SKINNY=all tries it on every 16-bit shape with
# DEFAULT_CONFIG (for the benchmark).
DEFAULT_CONFIG = (16, 512, 1, 4, 4)
SHAPES: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (3072, 2048, 16): (16, 256, 1, 4, 4),  # qkv: 1.0x alone, 8 us less per step at batch 1
    (2048, 2048, 16): (16, 512, 1, 4, 4),  # o_proj: 1.19x
    (16384, 2048, 16): (64, 256, 1, 4, 4),  # gate_up: 1.05x, 15 us less per step at batch 1
    (2048, 8192, 16): (16, 512, 1, 4, 4),  # down: 1.06-1.07x
    (128256, 2048, 16): (64, 256, 1, 4, 4),  # the LM head: 1.09-1.13x
    (2048, 2048, 64): (16, 256, 1, 4, 4),  # o_proj: 1.20x
    (16384, 2048, 64): (128, 128, 1, 4, 4),  # gate_up: 1.05x
    (2048, 8192, 64): (32, 256, 2, 4, 4),  # down: 1.13x (cuBLAS: split K and a reduction kernel)
    (128256, 2048, 64): (128, 128, 1, 4, 4),  # the LM head: 1.07x
    # the embedded model's (pd-tiny-code) at up to 16 rows, DEFAULT_CONFIG: its MTP graphs at
    # batch 1 took 117-119 / 133-134 us (verify / draft) against 131-132 / 143 with cuBLAS
    # (`profile_mtp.py --k 3 --batch 1`, two calls): launched programmatically, each product's
    # weight stream starts before the kernel before it ends
    (512, 256, 16): DEFAULT_CONFIG,  # qkv
    (256, 256, 16): DEFAULT_CONFIG,  # o_proj
    (1536, 256, 16): DEFAULT_CONFIG,  # gate_up
    (256, 768, 16): DEFAULT_CONFIG,  # down
    (4096, 256, 16): DEFAULT_CONFIG,  # the LM head (the embedding, tied)
    (256, 512, 16): DEFAULT_CONFIG,  # the MTP layer's eh_proj
}


def row_bucket(m: int) -> int:
    """BM: the rows a program multiplies for m rows of x (16, 32 or 64)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@functools.cache
def config_for(n: int, k: int, bm: int = 16) -> tuple[int, int, int, int, int] | None:
    mode = os.environ.get("PD_SKINNY", "1")
    if mode == "0":
        return None
    if mode == "all":
        return SHAPES.get((n, k, bm), DEFAULT_CONFIG)
    return SHAPES.get((n, k, bm))


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` runs the kernel for this x [M, K] and weight [N, K]."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.shape[1] == weight.shape[1]
            and triton_usable(x, "skinny_linear")
            and config_for(*weight.shape, row_bucket(x.shape[0])) is not None)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: F.linear, or the product it runs written into `out`."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counts(device: torch.device, size: int) -> torch.Tensor:
    """The slice counters of `device` (int32 zeros; every launch leaves them zero again), made
    on first use, before a graph captures the kernel (its warm-up run). One product runs at a
    time per device (a forward's layers are in stream order): its launches share them."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < size:
        counts = _COUNTS[device] = torch.zeros(max(size, 1 << 14), dtype=torch.int32, device=device)
    return counts


def gated_config(config: tuple[int, int, int, int, int] | None):
    """The configuration of the gated product (`skinny_linear(gated=True)`) from the plain
    product's of the same weight: half the columns per program, of gate and of up each, so a
    program streams as many weight rows; None (two kernels) where the plain one splits K, where
    half its columns are under one tensor-core tile, or with `PD_SILU_EPILOGUE=0`."""
    if config is None or config[2] != 1 or config[0] < 32:
        return None
    if os.environ.get("PD_SILU_EPILOGUE", "1") == "0":
        return None
    return (config[0] // 2, *config[1:])


def _gated_kernel_config(x: torch.Tensor, weight: torch.Tensor, m: int):
    return (gated_config(config_for(*weight.shape, row_bucket(m))) if use_skinny(x, weight)
            else None)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, use_kernel: bool | None = None,
                  config: tuple[int, int, int, int, int] | None = None,
                  gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, written into `out`
    when given: the kernel where `use_skinny` says so (or `use_kernel`), else the twin.
    `config` (BN, BK, SPLITS, STAGES, warps) overrides the table's, for the benchmark.
    `gated`: the weight is a gated MLP's gate rows then up rows and the result [M, N / 2] is
    `silu_and_mul` of the product, its SiLU and product in the kernel's epilogue where
    `gated_config` has a configuration (else the product, then `silu_and_mul`); a `config`
    given is then the gated launch's own (BN columns of gate and of up each)."""
    if gated:
        if use_kernel is None:
            config = config or _gated_kernel_config(x, weight, x.shape[0])
            use_kernel = config is not None
        if not use_kernel:
            y = silu_and_mul(skinny_linear(x, weight, bias))
            return y if out is None else out.copy_(y)
        if weight.shape[0] % 2:
            raise ValueError(f"weight {tuple(weight.shape)}: gate and up need an even row count")
    elif use_kernel is None:
        use_kernel = use_skinny(x, weight)
    if not use_kernel:
        return skinny_linear_ref(x, weight, bias, out)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or (bias is not None
                                                 and bias.shape != (weight.shape[0],)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                         f"{'' if bias is None else f', bias {tuple(bias.shape)}'} do not fit "
                         f"(at most {MAX_ROWS} rows)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_linear needs contiguous rows of x and of the weight")
    out = product_output(x, out, m, n)
    if config is None:
        config = config_for(*weight.shape, row_bucket(m)) or DEFAULT_CONFIG
        if gated:  # DEFAULT_CONFIG takes K in one slice
            config = gated_config(config) or DEFAULT_CONFIG
    launch_product(x, weight, bias, out, config, m, k, gated=gated)
    return out


def product_output(x: torch.Tensor, out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """The product's [m, n] output in x's dtype: `out` checked, or a new tensor."""
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit [{m}, {n}] {x.dtype}")
    return out


def launch_product(x, weight, bias, out, config, m: int, k: int, *, norm=None, rows=None,
                   h=None, gated=False):
    """One launch of the kernel: y = x' W^T (+ b) into `out`, x' the product's input after
    the prologue (`norm` (weight, eps, residual or None): the norm of x (+ residual), the
    stream written into `h`; `rows`: x's and the residual's rows to read); `gated`:
    silu_and_mul of it (one slice of K only)."""
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    bm = row_bucket(m)
    bn, bk, splits, stages, warps = config
    if gated and splits != 1:
        raise ValueError(f"config {config}: the gated product takes K in one slice")
    tiles = -(-n // bn)
    part = (torch.empty(splits, bm, n, dtype=torch.float32, device=x.device) if splits > 1
            else out)
    g, eps, r = norm if norm is not None else (weight, 0.0, None)
    _kernel()[(tiles, splits)](x, weight, bias if bias is not None else weight, out, part,
                               _counts(x.device, tiles), r if r is not None else x, g,
                               h if h is not None else out, rows if rows is not None else x,
                               m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               r.stride(0) if r is not None else 0,
                               h.stride(0) if h is not None else 0, eps,
                               HAS_BIAS=bias is not None, NORM=norm is not None,
                               HAS_RES=r is not None, HAS_ROWS=rows is not None, GATED=gated,
                               BM=bm, BN=bn, BK=bk, SPLITS=splits, STAGES=stages,
                               num_warps=warps, **pdl_options(x))
