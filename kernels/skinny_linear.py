"""`skinny_linear`: y = x W^T (+ b) for a few rows of x (a decode step of up to `MAX_ROWS`
sequences), as one Triton kernel with a torch twin.

At such a batch a linear layer is a stream of its weight matrix; for the 1B shape's o_proj
(2048 -> 2048), down (8192 -> 2048) and LM head (2048 -> 128256) cuBLAS picks kernels that read
the weights at 45-95% of the copy bandwidth. Here each program owns `BN` output columns
and streams their weight rows through the whole K dimension in `BK` slices, software-pipelined
`STAGES` deep; the rows of x are padded to 16 for one tensor-core dot per slice. Each output
row is computed alone, in the same order whatever the number of rows: a sequence's result
does not depend on the batch it is in.

Used for 16-bit weights where `use_skinny` says it measured faster (`SHAPES`, from
`benchmarks/gpu/bench_skinny.py`); on the current stream, capturable in a CUDA graph.
`triton` is imported on first use; CPU machines run the twin.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels.triton_support import triton_usable

MAX_ROWS = 16  # rows of x one program multiplies (a dot's smallest M)


@functools.cache
def _kernel():
    import triton  # noqa: PLC0415 (deferred: CPU machines have no triton)
    import triton.language as tl

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      STAGES: tl.constexpr):
        rm = tl.arange(0, 16)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        row_ok = rm < M
        col_ok = rn < N
        x_base = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_base = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([16, BN], tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            k_ok = (k0 + rk) < K
            x = tl.load(x_base + (k0 + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + (k0 + rk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)  # [16, BN]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return skinny_kernel


# (N, K) of a weight -> (BN, BK, STAGES, warps): the shapes where the kernel measured faster
# than cuBLAS at 1-16 rows on an H100 (`benchmarks/gpu/bench_skinny.py`); any other shape keeps
# cuBLAS. PD_SKINNY=0 turns the kernel off, PD_SKINNY=all tries it on every 16-bit shape with
# DEFAULT_CONFIG (for the benchmark).
SHAPES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (2048, 2048): (16, 512, 4, 4),  # o_proj: 1.02-1.05x
    (16384, 2048): (32, 256, 3, 4),  # gate_up: 1.01-1.04x
    (2048, 8192): (16, 512, 4, 4),  # down: 1.06-1.07x
    (128256, 2048): (64, 256, 4, 4),  # the LM head: 1.09-1.10x
}
DEFAULT_CONFIG = (16, 512, 4, 4)


@functools.cache
def config_for(n: int, k: int) -> tuple[int, int, int, int] | None:
    mode = os.environ.get("PD_SKINNY", "1")
    if mode == "0":
        return None
    if mode == "all":
        return SHAPES.get((n, k), DEFAULT_CONFIG)
    return SHAPES.get((n, k))


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` runs the kernel for this x [M, K] and weight [N, K]."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and triton_usable(x) and config_for(*weight.shape) is not None)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: F.linear, or the product it runs written into `out`."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, use_kernel: bool | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, written into `out`
    when given: the kernel where `use_skinny` says so (or `use_kernel`), else the twin."""
    if use_kernel is None:
        use_kernel = use_skinny(x, weight)
    if not use_kernel:
        return skinny_linear_ref(x, weight, bias, out)
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                         f"{'' if bias is None else f', bias {tuple(bias.shape)}'} do not fit "
                         f"(at most {MAX_ROWS} rows)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_linear needs contiguous rows of x and of the weight")
    bn, bk, stages, warps = config or config_for(n, k) or DEFAULT_CONFIG
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit [{m}, {n}] {x.dtype}")
    _kernel()[(-(-n // bn),)](x, weight, bias if bias is not None else weight, out, m, n, k,
                              x.stride(0), weight.stride(0), out.stride(0),
                              HAS_BIAS=bias is not None, BN=bn, BK=bk, STAGES=stages,
                              num_warps=warps)
    return out
