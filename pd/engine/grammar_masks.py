"""Structured output's masks in the sampler (`apply_grammar`): each grammar row's bitmask
(`SamplingRow.allowed`, int32 words on the host, `pd.engine.grammar`) copied to the device in
one go, straight from the page-locked buffer the decode loop filled where it can, and applied
by one kernel (`pd_kernels.token_mask`), without a host wait."""

from __future__ import annotations

import torch

from pd_kernels.token_mask import apply_token_mask
from pd.engine.host_ring import list_to_device, to_device


def _one_block(masks: list[torch.Tensor]) -> torch.Tensor | None:
    """The masks as one [M, W] view when they are consecutive rows of one buffer (as
    `ModelRunner.sampling_rows` fills them), else None."""
    first, width = masks[0], masks[0].numel()
    if first.dim() != 1 or first.stride(0) != 1:
        return None
    base, ptr, step = first.untyped_storage().data_ptr(), first.data_ptr(), width * first.element_size()
    for k, m in enumerate(masks):
        if (m.dim() != 1 or m.numel() != width or m.data_ptr() != ptr + k * step
                or m.untyped_storage().data_ptr() != base):
            return None
    return first.as_strided((len(masks), width), (width, 1))


def _whole_buffer(masks: list[torch.Tensor], rows: list[int], num_rows: int
                  ) -> torch.Tensor | None:
    """Where masks[k] is row rows[k] of one [num_rows, W] buffer (as the decode loop
    fills a step's masks: row j for the step's row j, some rows not masked, their grammars
    checked after sampling), that buffer [num_rows, W] with every other row allowing all
    tokens (-1, written here: those rows are this step's and unused): one copy and no index,
    rather than the masks stacked and their rows copied through the staging buffers. Else
    None."""
    first, width = masks[0], masks[0].numel()
    if first.dim() != 1 or first.stride(0) != 1 or first.storage_offset() < rows[0] * width:
        return None
    start = first.storage_offset() - rows[0] * width
    storage = first.untyped_storage()
    if (start + num_rows * width) * first.element_size() > storage.nbytes():
        return None
    for m, j in zip(masks, rows):
        if (m.dim() != 1 or m.numel() != width or m.storage_offset() != start + j * width
                or m.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
    whole = first.as_strided((num_rows, width), (width, 1), start)
    others = sorted(set(range(num_rows)) - set(rows))
    whole[others] = -1
    return whole


def apply_grammar(x: torch.Tensor, rows: list) -> None:
    """-inf on every token a row's grammar does not allow (the sampler's rows,
    `pd.engine.sampler.SamplingRow`: their `allowed`), in place on logits [B, V]; tokens past
    the mask's words are not allowed. One copy of the masks to the device (straight from their
    page-locked buffer when they are its consecutive rows) and one kernel
    (`pd_kernels.token_mask`), no wait."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return
    dev = x.device
    allowed = [rows[i].allowed for i in masked]
    block = _one_block(allowed)
    if block is None and dev.type == "cuda":
        block = _whole_buffer(allowed, masked, len(rows))
        if block is not None:
            masked = range(len(rows))
    # NOTE: a buffer of the runner's HostRing is not reused before this step is processed
    bits = block.to(dev, non_blocking=True) if block is not None else \
        to_device(torch.stack(allowed), dev)
    # NOTE: every row masked (a batch of grammars) needs no index copied from the host
    index = (torch.arange(len(rows), device=dev) if len(masked) == len(rows)
             else list_to_device(masked, torch.int64, dev))
    apply_token_mask(x, bits, index)
