"""`rms_norm`: RMSNorm of each row, optionally after adding the residual stream, as one Triton
kernel with a torch twin.

out = weight * (h / sqrt(mean(h^2) + eps)) with h = x (or x + residual, which is also returned as
the new residual stream), of every row or of given rows (a gather, an embedding lookup among
them), into a new tensor or given rows. Rounding follows the model's torch reference step by
step: the sum is rounded to x's dtype, the statistics are float32, the normalized row is rounded
to x's dtype before the weight multiplies it. One program per row; on the current stream,
capturable in a CUDA graph. `triton` is imported on first use; CPU machines run the twin.
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
    def rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, rows_ptr, stride_x, stride_r,
                        stride_o, stride_h, stride_rows, n_cols, eps, HAS_RESIDUAL: tl.constexpr,
                        HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # see pd_kernels.triton_support.pdl_options
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        src = tl.load(rows_ptr + row * stride_rows).to(tl.int64) if HAS_ROWS else row
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + src * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + src * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(x.dtype), mask=ok)

    return rms_norm_kernel


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, *, rows: torch.Tensor | None = None,
                 out: torch.Tensor | None = None):
    """The torch twin: x [..., H] -> out, or (out, x + residual) when a residual is given."""
    if rows is not None:
        x, residual = x[rows], None if residual is None else residual[rows]
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    normed = normed if out is None else out.copy_(normed)
    return normed if residual is None else (normed, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, use_kernel: bool | None = None, *,
             rows: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """RMSNorm of x's rows [T, H] (see the module docstring): the kernel on CUDA, else the twin.
    `rows` (int64 [N], any stride): only those rows of x and of the residual, in that order (x
    may be a table: an embedding lookup and its norm in one kernel); `out`: where the normed
    rows go ([N, H], the rows may be part of wider ones)."""
    if use_kernel is None:
        use_kernel = triton_usable(x, "rms_norm") and x.dim() == 2 and x.stride(-1) == 1
    if not use_kernel:
        return rms_norm_ref(x, weight, eps, residual, rows=rows, out=out)
    n, cols = x.shape if rows is None else (rows.shape[0], x.shape[1])
    if weight.shape != (cols,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x "
                         f"{tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit x")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype}: expected [N] int64")
    if out is None:
        out = torch.empty(n, cols, dtype=x.dtype, device=x.device)
    elif out.shape != (n, cols) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit [{n}, {cols}] {x.dtype}")
    h = torch.empty(n, cols, dtype=x.dtype, device=x.device) if residual is not None else out
    r = residual if residual is not None else x
    index = rows if rows is not None else x
    _kernel()[(n,)](x, r, weight, out, h, index, x.stride(0), r.stride(0), out.stride(0),
                    h.stride(0), index.stride(0), cols, eps, HAS_RESIDUAL=residual is not None,
                    HAS_ROWS=rows is not None, BLOCK=max(16, 1 << (cols - 1).bit_length()),
                    num_warps=4 if cols <= 4096 else 8, **pdl_options(x))
    return out if residual is None else (out, h)
