"""Whether a tensor's work may go to one of the decode layer's Triton kernels (`rms_norm`,
`rope_cache`, `activation`): on CUDA, with triton importable, unless `PD_TRITON=0` asks for
their torch twins (to compare, or to rule a kernel out). The decode attention has its own
switch, `PD_ATTENTION=torch` (`kernels.paged_decode.can_use_kernel`)."""

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


def triton_usable(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("PD_TRITON", "1") != "0" and triton_importable()
