"""Compiling and launching the CuPy RawKernels of this package on torch's current stream.

`cupy` is imported on first use only, never at module import, so CPU-only machines (CI) never
need it. A kernel is compiled once per (name, device) and launched with raw device pointers on
the stream torch is using, so it orders with the surrounding torch ops and never waits on the
host. Which implementation runs (kernel or torch twin) is decided by `use_kernels`; argument
checks shared by the wrappers live here too.
"""

from __future__ import annotations

import functools
import os

import torch

THREADS = 128  # threads per block: every kernel here is one thread per slot


@functools.cache
def _cupy():
    import cupy  # noqa: PLC0415 (deferred: CPU machines have no cupy)

    return cupy


def cupy_available() -> bool:
    try:
        _cupy()
    except Exception:  # ImportError, or a CUDA runtime cupy cannot load
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    """Whether a tensor's bookkeeping runs as a RawKernel: on CUDA with cupy present, unless
    `PD_KERNELS=torch` asks for the torch twins."""
    return t.is_cuda and os.environ.get("PD_KERNELS", "cupy") != "torch" and cupy_available()


@functools.cache
def _compiled(name: str, source: str, device_index: int):
    cp = _cupy()
    with cp.cuda.Device(device_index):
        return cp.RawKernel(source, name, options=("--std=c++17",))


def launch(name: str, source: str, num_threads: int, args: list) -> None:
    """Launch kernel `name` from `source` with one thread per item, on torch's current stream.
    `args`: torch tensors (passed as device pointers) and `numpy` scalars."""
    if num_threads == 0:
        return
    cp = _cupy()
    import numpy as np  # noqa: PLC0415

    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    kernel = _compiled(name, source, device.index or 0)
    raw = [np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
    blocks = (num_threads + THREADS - 1) // THREADS
    with cp.cuda.Device(device.index or 0), current_stream(device):
        kernel((blocks,), (THREADS,), tuple(raw))


def current_stream(device: torch.device):
    """torch's current stream on `device` as a CuPy stream (`with` it, kernels launch there)."""
    return _external(torch.cuda.current_stream(device).cuda_stream, device.index or 0)


@functools.cache
def _external(handle: int, device_index: int):
    # NOTE: one wrapper per torch stream, made once instead of at every launch
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ExternalStream's successor needs
        return _cupy().cuda.ExternalStream(handle, device_index)  # the stream protocol


def check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """Refuse a tensor of the wrong dtype, shape (None = any size), device or layout."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
