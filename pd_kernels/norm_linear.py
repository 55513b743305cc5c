"""`norm_linear`: RMSNorm (after the residual add) then a product, as one launch of
`pd_kernels.skinny_linear`'s kernel with its norm prologue where that measured faster than the
two kernels, else `pd_kernels.rms_norm` then `skinny_linear`; the same rounding either way.

The prologue reads x's rows, or gathered rows (an embedding lookup), adds the residual, and
normalizes each tile as the product loads it, rounded as `pd_kernels.rms_norm` rounds; the first
program writes the residual stream after the add. Every program recomputes the norm over whole
rows (the norm's statistics span all of K), so it serves small K only (`PROLOGUE_SHAPES`). With
`gated`, the product's SiLU-and-multiply epilogue too (`skinny_linear`'s `gated`). On the
current stream, capturable in a CUDA graph; CPU machines run the twins.
"""

from __future__ import annotations

import os

import torch

from pd_kernels.activation import silu_and_mul
from pd_kernels.rms_norm import rms_norm
from pd_kernels.skinny_linear import (DEFAULT_CONFIG, MAX_ROWS, config_for, gated_config,
                                      launch_product, product_output, row_bucket,
                                      skinny_linear)
from pd_kernels.triton_support import triton_usable


# (N, K, BM) -> the kernel's configuration with the norm prologue, where one kernel measured
# faster than the two it replaces (the norm kernel, then the product), each in a CUDA graph of
# its launches (`benchmarks/gpu/bench_skinny.py --prologues`, rows 1 and 4, H100); any other
# shape runs the two kernels. Every program recomputes the norm over whole rows: the embedded
# model's K of 256 costs nothing there, and a launch goes. (SiLU-and-multiply as the down
# projection's prologue measured 2-2.5x slower than its two kernels, in every configuration
# tried: not used.)
PROLOGUE_SHAPES: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (512, 256, 16): (16, 256, 1, 2, 4),  # qkv: 2.15-2.32 us against 3.01-3.15
    (1536, 256, 16): (16, 256, 1, 2, 4),  # gate_up: 2.25-2.40 against 3.18-3.27
    (4096, 256, 16): (32, 256, 1, 1, 4),  # the LM head: 2.40-2.72 against 4.19-4.30
}


def prologue_config(m: int, weight: torch.Tensor, x: torch.Tensor):
    """The configuration for `norm_linear` to fuse the norm into the kernel for m rows of x
    (`PROLOGUE_SHAPES`), or None: two kernels (`PD_PROLOGUE=0`: always)."""
    # NOTE: the CPU's answer first (every linear layer of an eager step asks), the environment last
    if (m > MAX_ROWS or not triton_usable(x, "skinny_linear")
            or x.dtype not in (torch.bfloat16, torch.float16)
            or weight.dtype != x.dtype or x.stride(-1) != 1 or weight.stride(-1) != 1
            or os.environ.get("PD_PROLOGUE", "1") == "0"):
        return None
    return PROLOGUE_SHAPES.get((*weight.shape, row_bucket(m)))


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, use_kernel: bool | None = None,
                out: torch.Tensor | None = None, config=None, gated: bool = False):
    """RMSNorm then the product: (linear(rms_norm(h)), h) with h = x (or x + residual), of x's
    rows or of `rows` of x and the residual (an embedding lookup, x the table): h is the
    residual stream after the add, what the next norm adds; the product into `out` when given.
    One kernel where `prologue_config` has a configuration (or `use_kernel`; `config`
    overrides), else `pd_kernels.rms_norm` and `skinny_linear`; the same rounding. `gated`:
    `silu_and_mul` of the product in place of it (`skinny_linear`'s `gated`), in the same
    launch where `gated_config` halves the plain product's configuration (which `config` is)."""
    m, k = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    if use_kernel is None:
        config = config or prologue_config(m, weight, x)
        use_kernel = (config is not None and weight.shape[1] == k and norm_weight.dtype == x.dtype
                      and (rows is None or rows.dtype == torch.int64)
                      and (residual is None or (residual.dtype == x.dtype
                                                and residual.stride(-1) == 1)))
    if not use_kernel:
        return _norm_linear_split(x, norm_weight, eps, weight, bias, residual, rows, out, gated)
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype}: expected [N] int64")
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
                         f"(at most {MAX_ROWS} rows)")
    n = weight.shape[0]
    config = config or config_for(n, k, row_bucket(m)) or DEFAULT_CONFIG
    # gated: the epilogue too where the configuration allows it, else silu_and_mul after
    fused = gated_config(config) if gated else None
    y = product_output(x, out if not gated or fused else None, m, n // 2 if fused else n)
    h = (torch.empty(m, k, dtype=x.dtype, device=x.device)
         if residual is not None or rows is not None else None)
    launch_product(x, weight, bias, y, fused or config, m, k, norm=(norm_weight, eps, residual),
            rows=rows, h=h, gated=fused is not None)
    if gated and not fused:
        y = silu_and_mul(y) if out is None else out.copy_(silu_and_mul(y))
    return y, (x if h is None else h)


def _norm_linear_split(x, norm_weight, eps, weight, bias, residual, rows, out, gated=False):
    """`norm_linear` as two kernels (or their twins)."""
    if residual is not None:
        normed, stream = rms_norm(x, norm_weight, eps, residual, rows=rows)
    else:
        stream = x if rows is None else x.index_select(0, rows)
        normed = rms_norm(stream, norm_weight, eps)
    return skinny_linear(normed, weight, bias, out, gated=gated), stream
