"""The GPU's 16-bit matrix products checked once as a process takes the device, before a model
is loaded: a few products of random inputs on the device against the same products in float32
on the CPU, and a refusal to start where they differ past rounding.

Why: on an H100 (driver 580, CUDA 13, torch 2.11) a process limited by MPS to a share of the
multiprocessors (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) got bf16 and fp16 products from cuBLAS that
were wrong by whole units at most shares (75%: 98 of 132 multiprocessors, but also 85% down to
55%, 40%, 30%), right at 100, 95, 90, 50 and 25%, with no error raised: a node there produced
garbage tokens with exit code 0 (`benchmarks/gpu/check_sm_share.py` finds it). float32 products
were right at every share. The shapes below are ones that went wrong there; the check costs a
few milliseconds on the device and 32 GFLOP on the CPU (0.45 s on two cores).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# (rows, K, N) of x [rows, K] @ w [N, K]^T: the 1B shape's products at a decode batch of 16
# and 64 and at a prefill of 512 and 1024 tokens, and the embedded model's MLP at 150 tokens;
# each share above that went wrong did in at least one of these (at 75%: the batch-64 pair,
# the 1024-token product and the 150-token MLP; the 512-token one was not tried alone)
SHAPES = ((16, 2048, 3072), (64, 2048, 16384), (64, 8192, 2048), (512, 2048, 8192),
          (1024, 2048, 2048), (150, 256, 1536))
# inputs and weights scaled so that each output is about N(0, 1): rounding to 16 bits moves it
# by a few thousandths; the wrong products were off by 2 to 7 (fp16: up to 515)
RTOL, ATOL = 0.02, 0.05


class DeviceCheckError(RuntimeError):
    pass


# (device, dtype) pairs this process has checked: a process's MPS share is fixed when its CUDA
# context starts, so a second engine of the same process (tests, benchmarks) need not pay again
_CHECKED: set[tuple[torch.device, torch.dtype]] = set()


def may_check_products(device: torch.device, dtype: torch.dtype) -> None:
    """`check_products` where there is something to check: 16-bit products on a CUDA device,
    once per process."""
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and (device, dtype) not in _CHECKED):
        check_products(device, dtype)
        _CHECKED.add((device, dtype))


def check_products(device: torch.device, dtype: torch.dtype, shapes=SHAPES,
                   linear: Callable = F.linear) -> None:
    """Raise DeviceCheckError where a `dtype` product on `device` differs from float32 on the
    CPU past rounding. `linear` is the product under test (F.linear; a wrong one in the
    tests)."""
    # NOTE: the inputs are drawn on the device (on the CPU, drawing them took three times as
    # long as the float32 products: 1.5 s on two cores); which numbers they are does not
    # matter, only that both sides take the same ones
    gen = torch.Generator(device=device).manual_seed(0)
    for rows, k, n in shapes:
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
        got = linear(x, w).float().cpu()
        want = F.linear(x.cpu().float(), w.cpu().float())
        bad = ~torch.isclose(got, want, rtol=RTOL, atol=ATOL)
        if bool(bad.any()):
            share = _mps_share()
            finite = bool(torch.isfinite(got).all())
            how = (f"by up to {float((got - want).abs().max()):.3g}" if finite
                   else f"{int((~torch.isfinite(got)).sum())} of them NaN or infinite")
            raise DeviceCheckError(
                f"{device}: a {str(dtype).removeprefix('torch.')} matrix product [{rows}, {k}] x "
                f"[{k}, {n}] computed wrong on this GPU ({int(bad.sum())} of {bad.numel()} values "
                f"off, {how}), so this process would "
                f"produce wrong tokens; "
                + (f"it runs under MPS limited to {share}% of the multiprocessors "
                   "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), where cuBLAS's 16-bit products have "
                   "gone wrong before: run it at 100%, or at a share the check passes (on an "
                   "H100: 90 or 50)" if share else "--dtype float32 avoids 16-bit products"))
    log.debug("%s: %s products checked against float32 (%d shapes)", device, dtype, len(shapes))


def _mps_share() -> str | None:
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return share if share and share != "100" else None
