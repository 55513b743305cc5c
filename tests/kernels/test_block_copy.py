"""`pd_kernels.block_copy.copy_blocks`: gather and scatter of KV blocks between [R, N, ...] layouts,
the twin against a block-by-block reference on CPU, and the kernel against the twin on a GPU."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.block_copy import copy_blocks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _case(device, dtype=torch.float32, rows=6, blocks=40, n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(rows, blocks, 16, 2, 8, generator=g).to(dtype).to(device)
    ids = torch.randperm(blocks, generator=g)[:n].to(device)
    return src, ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_kernel", [False, True])
def test_gather_then_scatter(device, use_kernel):
    if use_kernel and device == "cpu":
        pytest.skip("the kernel needs a CUDA device")
    src, ids = _case(device, torch.bfloat16)
    staged = torch.zeros(src.shape[0], ids.numel(), *src.shape[2:], dtype=src.dtype, device=device)
    copy_blocks(src, staged, src_ids=ids, use_kernel=use_kernel)
    for j, b in enumerate(ids.tolist()):
        assert torch.equal(staged[:, j], src[:, b])
    dst = torch.zeros_like(src)
    back = torch.randperm(src.shape[1])[:ids.numel()].to(device)
    copy_blocks(staged, dst, dst_ids=back, use_kernel=use_kernel)
    for j, b in enumerate(back.tolist()):
        assert torch.equal(dst[:, b], staged[:, j])
    untouched = torch.ones(src.shape[1], dtype=torch.bool)
    untouched[back.cpu()] = False
    assert (dst[:, untouched.to(device)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_both_ids(device):
    """Rows of a cache slice (dimension 0 strided over layers and K/V), ids on both sides."""
    kv = torch.randn(4, 2, 30, 16, 2, 8, device=device)
    src = kv[1:3].flatten(0, 1)
    dst = torch.zeros(4, 30, 16, 2, 8, device=device)
    a, b = torch.tensor([3, 7, 29], device=device), torch.tensor([0, 5, 6], device=device)
    copy_blocks(src, dst, src_ids=a, dst_ids=b)
    assert torch.equal(dst[:, b], src[:, a])


def test_refuses_mismatches():
    src, ids = _case("cpu")
    with pytest.raises(ValueError, match="do not match"):
        copy_blocks(src, torch.zeros(5, 3, 16, 2, 8), src_ids=ids[:3])
    with pytest.raises(ValueError, match="int64"):
        copy_blocks(src, torch.zeros_like(src), src_ids=ids.int())
