"""`silu_and_mul`: the gated MLP's SiLU(gate) * up over the fused gate/up projection, as one
Triton kernel with a torch twin.

x [T, 2I] holds gate in its first I columns and up in the last I; out [T, I] = silu(gate) * up,
silu rounded to x's dtype before the product as the torch reference does. On the current
stream, capturable in a CUDA graph. `triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pd_kernels.triton_support import pdl_options, triton_usable

BLOCK = 1024


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: PLC0415

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # see pd_kernels.triton_support.pdl_options
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)

    return silu_and_mul_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul(x: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """SiLU(gate) * up of x [T, 2I] -> [T, I]: the kernel on CUDA, else the twin."""
    if use_kernel is None:
        use_kernel = triton_usable(x, "activation") and x.dim() == 2 and x.stride(-1) == 1
    if not use_kernel:
        return silu_and_mul_ref(x)
    rows, cols = x.shape
    if cols % 2:
        raise ValueError(f"x has {cols} columns: gate and up need an even count")
    out = torch.empty(rows, cols // 2, dtype=x.dtype, device=x.device)
    _kernel()[(rows, -(-(cols // 2) // BLOCK))](x, out, x.stride(0), out.stride(0), cols // 2,
                                                BLOCK=BLOCK, num_warps=4, **pdl_options(x))
    return out
