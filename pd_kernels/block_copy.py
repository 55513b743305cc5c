"""`copy_blocks`: KV blocks from one paged layout to another in one kernel, for the KV transfer.

Both sides are viewed as [R, N, U] bytes (R rows = layers x {K, V}, N blocks, U bytes of one
block of one row): dst[r, dst_ids[j]] = src[r, src_ids[j]] for every row r and j < n. A missing
id list means j itself. The sender gathers a chunk of a request's blocks from its cache into a
contiguous staging buffer (src_ids = the request's blocks) before one DMA copy to the host; the
receiver scatters a staged chunk into the blocks it reserved (dst_ids). One CUDA block per
(j, r), 16-byte copies; a CuPy RawKernel on torch's current stream, with its torch twin
(index_select / index_copy_ on the same views), which CPU machines run.
"""

from __future__ import annotations

import torch

from pd_kernels.launch import use_kernels

SOURCE = r"""
extern "C" __global__ void copy_blocks(
    const char* __restrict__ src, char* __restrict__ dst, const long long* __restrict__ src_ids,
    const long long* __restrict__ dst_ids, long long src_row, long long dst_row, long long unit)
{
    long long j = blockIdx.x, r = blockIdx.y;
    long long s = src_ids ? src_ids[j] : j, d = dst_ids ? dst_ids[j] : j;
    const uint4* __restrict__ from = (const uint4*)(src + r * src_row + s * unit);
    uint4* __restrict__ to = (uint4*)(dst + r * dst_row + d * unit);
    long long n = unit / 16, i = threadIdx.x, step = blockDim.x;
    for (; i + 3 * step < n; i += 4 * step) {  // four loads in flight before their stores
        uint4 a = from[i], b = from[i + step], c = from[i + 2 * step], e = from[i + 3 * step];
        to[i] = a; to[i + step] = b; to[i + 2 * step] = c; to[i + 3 * step] = e;
    }
    for (; i < n; i += step) to[i] = from[i];
}
"""

THREADS = 256


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[R, N, ...] -> [R, N, U] uint8 view (the trailing dimensions contiguous)."""
    return t.reshape(t.shape[0], t.shape[1], -1).view(torch.uint8)


def compile_kernel(device: torch.device) -> None:
    """Compile (or load from CuPy's cache) the kernel for `device` now, so that a node's first
    KV transfer does not pay for it; nothing on CPU or without cupy."""
    if device.type == "cuda" and use_kernels(torch.empty(0, device=device)):
        from pd_kernels.launch import _compiled  # noqa: PLC0415

        _compiled("copy_blocks", SOURCE, device.index or 0)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor | None = None,
                dst_ids: torch.Tensor | None = None, use_kernel: bool | None = None) -> None:
    """dst[r, dst_ids[j]] = src[r, src_ids[j]] for r < R, j < n (n: the ids' length, or the
    other side's N when both are None). src and dst [R, N, ...] of one dtype, contiguous from
    dimension 1 on (dimension 0 may be strided); ids int64 on their device."""
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"blocks {tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} "
                         f"{dst.dtype} do not match")
    ids = src_ids if src_ids is not None else dst_ids
    n = ids.numel() if ids is not None else src.shape[1]
    for t in (src_ids, dst_ids):
        if t is not None and (t.dtype != torch.int64 or t.numel() != n or t.device != src.device):
            raise ValueError(f"block ids {t.dtype} x {t.numel()} on {t.device}: expected int64 "
                             f"x {n} on {src.device}")
    s, d = _rows(src), _rows(dst)
    unit = s.shape[2]
    if use_kernel if use_kernel is not None else use_kernels(src):
        if any(t.stride(1) != unit or t.stride(2) != 1 for t in (s, d)):
            raise ValueError("copy_blocks needs contiguous blocks")
        launch_copy(s.data_ptr(), d.data_ptr(), s.shape[0], unit, s.stride(0), d.stride(0), n,
                    src.device, src_ids, dst_ids)
        return
    picked = s if src_ids is None else s.index_select(1, src_ids)
    if dst_ids is None:
        d[:, :n].copy_(picked[:, :n])
    else:
        d.index_copy_(1, dst_ids, picked)


def launch_copy(src: int, dst: int, rows: int, unit: int, src_row: int, dst_row: int, n: int,
                device: torch.device, src_ids: torch.Tensor | None = None,
                dst_ids: torch.Tensor | None = None) -> None:
    """The kernel on raw addresses, on torch's current stream of `device`: rows of `unit` bytes,
    `src_row` / `dst_row` bytes apart, `n` blocks each (ids int64 on `device`, or j itself).
    `dst` may be another process's memory opened by CUDA IPC (`shm_ipc.cuda_ipc`), on this GPU
    or on a peer one."""
    if unit % 16 or src % 16 or dst % 16 or src_row % 16 or dst_row % 16:
        raise ValueError("copy_blocks needs 16-byte aligned blocks")
    if n == 0 or rows == 0:
        return
    import numpy as np  # noqa: PLC0415

    from pd_kernels.launch import _compiled, _cupy, current_stream  # noqa: PLC0415
    dev = device.index or 0
    kernel = _compiled("copy_blocks", SOURCE, dev)
    ptr = lambda t: np.uint64(t.data_ptr() if t is not None else 0)  # noqa: E731
    with _cupy().cuda.Device(dev), current_stream(device):
        kernel((n, rows), (THREADS,), (np.uint64(src), np.uint64(dst), ptr(src_ids), ptr(dst_ids),
                                       np.int64(src_row), np.int64(dst_row), np.int64(unit)))
