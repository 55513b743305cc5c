"""KV helpers: chunk planning under a record limit, gather into ring memory, install on the receiver."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shm_ipc import header
from shm_ipc.header import Flag
from shm_ipc.kv import (DMA_ENV, MAX_DMA_RUNS, chunk_shape, dma_plan, gather_into,
                        gather_pipelined, install_kv, plan_chunks, unit_bytes)
from shm_ipc.records import KV_DATA_OFFSET, decode, kv_meta
from shm_ipc.ring import ALIGN, Ring, record_size


def test_plan_covers_every_layer_and_block_once_under_the_limit():
    for layers, blocks, unit, limit in [(5, 7, 100, 1000), (3, 50, 100, 1000), (1, 1, 10, 10),
                                        (29, 33, 64, 64 * 33 * 2 + 1)]:
        chunks = plan_chunks(layers, blocks, unit, limit)
        covered = sorted((layer, b) for l0, l1, b0, b1 in chunks
                         for layer in range(l0, l1) for b in range(b0, b1))
        assert covered == [(layer, b) for layer in range(layers) for b in range(blocks)]
        assert all((l1 - l0) * (b1 - b0) * unit <= limit for l0, l1, b0, b1 in chunks)
    with pytest.raises(ValueError, match="exceeds"):
        plan_chunks(2, 2, 101, 100)


def test_a_1gib_request_needs_only_max_record_sized_records():
    # 33 layers (32 target + MTP), 8 KV heads x 128 dims, 16-token blocks, bf16: 64 KiB per unit
    unit = 2 * 16 * 8 * 128 * 2
    blocks = (1 << 30) // (33 * unit) + 1
    chunks = plan_chunks(33, blocks, unit, 16 << 20)
    assert sum((l1 - l0) * (b1 - b0) * unit for l0, l1, b0, b1 in chunks) >= 1 << 30
    assert max((l1 - l0) * (b1 - b0) * unit for l0, l1, b0, b1 in chunks) <= 16 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_into_ring_and_install_into_other_blocks(seg_name, dtype):
    torch.manual_seed(0)
    src = torch.randn(3, 2, 12, 4, 2, 8).to(dtype)  # [layers, K/V, blocks, block_size, heads, dim]
    dst = torch.zeros_like(src)
    src_ids, dst_ids = [7, 2, 9, 4, 11], [0, 5, 1, 10, 3]
    ids = torch.tensor(src_ids)
    chunks = plan_chunks(3, 5, unit_bytes(src), 2 * unit_bytes(src))  # one layer, 2 blocks each
    assert len(chunks) == 9
    with Ring.create(seg_name, 1 << 16) as prod, Ring.attach(seg_name) as cons:
        for chunk in chunks:
            l0, l1, b0, b1 = chunk
            nbytes = (l1 - l0) * (b1 - b0) * unit_bytes(src)
            view = prod.reserve(header.pack(Flag.KV), KV_DATA_OFFSET + nbytes)
            view[:KV_DATA_OFFSET] = kv_meta("req", l0, l1, b0, b1 - b0, str(dtype)[6:])
            gather_into(src, ids, chunk, view[KV_DATA_OFFSET:])
            prod.commit()
            word, body = cons.next_record()
            install_kv(decode(word, body), dst, dst_ids)
            cons.release()
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [b for b in range(12) if b not in dst_ids]
    assert not dst[:, :, untouched].any()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_sender_publishes_in_order_and_frees_a_full_ring(seg_name, depth):
    """`gather_pipelined` through a ring with room for two records: it keeps at most `depth`
    records unpublished, publishes them in order, and publishes what it holds before a
    reservation that would wait, so that the receiver (released on each publish, as the decode
    node is woken by each doorbell) frees the space; without that, reserve would time out."""
    torch.manual_seed(1)
    src = torch.randn(4, 2, 16, 4, 2, 8)
    dst = torch.zeros_like(src)
    src_ids, dst_ids = [3, 9, 0, 14, 7, 5, 11, 2], [1, 0, 15, 6, 8, 12, 4, 10]
    unit = unit_bytes(src)
    chunks = plan_chunks(4, 8, unit, 2 * unit)  # 16 records of one layer x 2 blocks
    record = KV_DATA_OFFSET + 2 * unit
    capacity = 2 * record_size(record) + 2 * ALIGN  # two records, never three
    seen, most_pending = [], 0
    with Ring.create(seg_name, capacity) as prod, Ring.attach(seg_name) as cons:
        def reserve(chunk):
            nonlocal most_pending
            l0, l1, b0, b1 = chunk
            view = prod.reserve(header.pack(Flag.KV), record, timeout=0.5)
            most_pending = max(most_pending, prod.num_pending)
            view[:KV_DATA_OFFSET] = kv_meta("req", l0, l1, b0, b1 - b0, "float32")
            return view[KV_DATA_OFFSET:]

        def publish():
            prod.commit()
            while (rec := cons.next_record(prod.write_pos)) is not None:
                kv_rec = decode(*rec)
                seen.append((kv_rec.layer_start, kv_rec.block_start))
                install_kv(kv_rec, dst, dst_ids)
            cons.release()

        gather_pipelined(src, torch.tensor(src_ids), chunks, reserve, publish, depth=depth,
                         fits=lambda chunk: prod.fits(record))
    assert seen == [(l0, b0) for l0, _, b0, _ in chunks]
    assert most_pending == min(depth, 2)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])


def test_install_refuses_mismatched_geometry_and_dtype():
    kv = torch.randn(2, 2, 4, 4, 2, 8)
    data = bytearray(2 * 2 * unit_bytes(kv))
    gather_into(kv, torch.tensor([1, 2]), (0, 2, 0, 2), memoryview(data))
    rec = decode(header.pack(Flag.KV), kv_meta("r", 0, 2, 0, 2, "float32"), raw=data)
    with pytest.raises(ValueError, match="does not fit"):
        install_kv(rec, torch.zeros(2, 2, 4, 8, 2, 8), [0, 1])
    with pytest.raises(ValueError, match="carries float32"):
        install_kv(rec, torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.float16), [0, 1])
    with pytest.raises(ValueError, match="only 1 are given"):
        install_kv(rec, torch.zeros_like(kv), [0])
    out = torch.zeros_like(kv)
    install_kv(rec, out, [3, 0])
    assert torch.equal(out[:, :, [3, 0]], kv[:, :, [1, 2]])


def test_pin_without_cuda_is_refused_quietly(seg_name):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: test_cuda_fast_path covers it")
    with Ring.create(seg_name, 1 << 16) as ring:
        assert ring.seg.pin() is False
        assert ring.seg.pin() is False  # once decided, not retried


@pytest.mark.parametrize("ids", [[5, 6, 7, 8, 2, 3, 30, 11, 12, 13], list(range(40)), [9]])
def test_dma_plan_moves_the_chunk_bytes(ids):
    """`dma_plan`'s 2-D copies, run here on bytes, give the chunk `kv[l0:l1, :, ids]` and put it
    back: one copy per run of consecutive ids, a row per (layer, K/V) plane."""
    kv = torch.randn(5, 2, 40, 4, 2, 8)
    l0, l1 = 1, 4
    plan = dma_plan(kv, l0, l1, ids)
    runs = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))
    assert len(plan) == runs and all(c.height == 2 * (l1 - l0) for c in plan)
    cache = kv.view(-1).view(torch.uint8).numpy()
    chunk = np.zeros(int(np.prod(chunk_shape(kv, l0, l1, len(ids)))) * kv.element_size(), np.uint8)
    for c in plan:
        for r in range(c.height):
            at, to = c.cache + r * c.cache_pitch, c.chunk + r * c.chunk_pitch
            chunk[to:to + c.width] = cache[at:at + c.width]
    got = torch.from_numpy(chunk).view(torch.float32).view(chunk_shape(kv, l0, l1, len(ids)))
    assert torch.equal(got, kv[l0:l1].index_select(2, torch.tensor(ids)))
    back = np.zeros_like(cache)
    for c in plan:
        for r in range(c.height):
            at, to = c.chunk + r * c.chunk_pitch, c.cache + r * c.cache_pitch
            back[to:to + c.width] = chunk[at:at + c.width]
    restored = torch.from_numpy(back).view(torch.float32).view(kv.shape)
    assert torch.equal(restored[l0:l1, :, ids], kv[l0:l1, :, ids])
    assert not restored[:l0].any() and not restored[l1:].any()


def test_dma_plan_leaves_scattered_blocks_to_the_kernel():
    kv = torch.zeros(2, 2, 4 * MAX_DMA_RUNS, 4, 2, 8)
    assert dma_plan(kv, 0, 2, list(range(0, 2 * MAX_DMA_RUNS, 2))) is not None
    assert dma_plan(kv, 0, 2, list(range(0, 2 * MAX_DMA_RUNS + 2, 2))) is None
    assert dma_plan(kv, 0, 2, []) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the KV fast path needs a CUDA device")
@pytest.mark.parametrize("dma", ["1", "0"])
def test_cuda_fast_path_through_pinned_rings(seg_name, dma, monkeypatch):
    """GPU cache -> page-locked ring -> GPU cache, non-contiguous blocks, every chunk intact:
    by DMA alone (`dma_plan`) and through the block-copy kernel (`PD_KV_DMA=0`)."""
    monkeypatch.setenv(DMA_ENV, dma)
    src = torch.randn(4, 2, 40, 16, 2, 64, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    src_ids, dst_ids = [31, 2, 17, 4, 39, 8, 23], [0, 5, 1, 30, 3, 12, 19]
    chunks = plan_chunks(4, 7, unit_bytes(src), 3 * unit_bytes(src))
    with Ring.create(seg_name, 1 << 20) as prod, Ring.attach(seg_name) as cons:
        assert prod.seg.pin() and cons.seg.pin()
        for chunk in chunks:
            l0, l1, b0, b1 = chunk
            nbytes = (l1 - l0) * (b1 - b0) * unit_bytes(src)
            view = prod.reserve(header.pack(Flag.KV), KV_DATA_OFFSET + nbytes)
            view[:KV_DATA_OFFSET] = kv_meta("req", l0, l1, b0, b1 - b0, "bfloat16")
            gather_into(src, torch.tensor(src_ids), chunk, view[KV_DATA_OFFSET:])
            prod.commit()
            word, body = cons.next_record()
            rec = decode(word, body)
            assert torch.frombuffer(rec.payload, dtype=torch.uint8).is_pinned()
            install_kv(rec, dst, dst_ids)
            cons.release()
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    assert not dst[:, :, [b for b in range(40) if b not in dst_ids]].any()
