"""Whether a tensor's work may go to one of the Triton kernels (`rms_norm`, `rope_cache`,
`activation`, `skinny_linear`, `argmax`, `masked_argmax`, `token_logprob`, `token_mask`): on
CUDA, with triton importable, unless `PD_TRITON=0` asks for every one's torch twin or
`PD_TRITON_OFF=name,name` for those named (to compare, or to rule a kernel out). The decode
attention has its own switch, `PD_ATTENTION=torch` (`pd_kernels.paged_decode.can_use_kernel`).
`pdl_options`: how those kernels are launched back to back on a Hopper GPU (`PD_PDL=0` turns it
off)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except Exception:  # ImportError, or a broken install
        return False
    return True


def triton_usable(t: torch.Tensor, kernel: str | None = None) -> bool:
    """Whether `t`'s work may go to the Triton kernel named `kernel` (its module's name in
    `pd_kernels`): on CUDA, with triton importable, unless `PD_TRITON=0` (every kernel) or
    `PD_TRITON_OFF` (a comma-separated list of kernel names) asks for the torch twin."""
    if not t.is_cuda or os.environ.get("PD_TRITON", "1") == "0" or not triton_importable():
        return False
    off = os.environ.get("PD_TRITON_OFF")
    return not off or kernel is None or kernel not in off.split(",")


@functools.cache
def _pdl_device(index: int) -> bool:
    if os.environ.get("PD_PDL", "1") == "0" or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415
    except Exception:  # ImportError, or a triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_options(t: torch.Tensor) -> dict:
    """A decode-layer kernel's launch options for programmatic dependent launch (PDL): on a
    Hopper or newer GPU (and unless `PD_PDL=0`), `PDL=True` compiles the kernel's prologue
    (`griddepcontrol`: wait for the kernel before it, then let the next one launch) and
    `launch_pdl=True` launches it so that its programs may start while the kernel before it
    finishes: what does not depend on that kernel (a weight prefetch) overlaps its tail, and
    the launch gap between the two goes. Every kernel launched so waits before it reads or
    writes anything the kernels before it touch."""
    if t.is_cuda and _pdl_device(t.device.index if t.device.index is not None
                                 else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
