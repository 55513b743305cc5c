"""The start-up check of 16-bit products (`pd.engine.device_check`) on the CPU: a right product
passes, a wrong one (a stand-in for what cuBLAS returned under an MPS share) is refused with the
share named; off CUDA and in float32 nothing runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pd.engine import device_check
from pd.engine.device_check import DeviceCheckError, check_products, may_check_products

SMALL = ((16, 128, 96), (5, 64, 32))
CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_right_product_passes(dtype):
    check_products(CPU, dtype, SMALL)


def off_by_one_in_a_corner(x, w):
    y = F.linear(x, w)
    y[-1, -1] += 1.0
    return y


def test_one_value_wrong_by_a_unit_is_refused_and_says_what_to_do(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    with pytest.raises(DeviceCheckError, match=r"\[16, 128\] x \[128, 96\].*1 of 1536.*float32"):
        check_products(CPU, torch.bfloat16, SMALL, linear=off_by_one_in_a_corner)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "75")
    with pytest.raises(DeviceCheckError, match="limited to 75% of the multiprocessors"):
        check_products(CPU, torch.bfloat16, SMALL, linear=off_by_one_in_a_corner)


def test_a_nan_is_refused_and_named_as_such():
    def one_nan(x, w):
        y = F.linear(x, w)
        y[0, 0] = float("nan")
        return y

    with pytest.raises(DeviceCheckError, match=r"1 of 1536 values off, 1 of them NaN or infinite"):
        check_products(CPU, torch.bfloat16, SMALL, linear=one_nan)


def test_rounding_to_16_bits_is_not_an_error():
    def rounded_twice(x, w):  # the output's rounding, then as much again
        y = F.linear(x.float(), w.float())
        return (y + (y - y.to(torch.bfloat16).float())).to(torch.bfloat16)

    check_products(CPU, torch.bfloat16, SMALL, linear=rounded_twice)


def test_only_16_bit_products_on_cuda_are_checked_once_each(monkeypatch):
    calls = []
    monkeypatch.setattr(device_check, "check_products", lambda *a: calls.append(a))
    monkeypatch.setattr(device_check, "_CHECKED", set())
    may_check_products(CPU, torch.bfloat16)
    may_check_products(torch.device("cuda", 0), torch.float32)
    assert calls == []
    may_check_products(torch.device("cuda", 0), torch.float16)
    may_check_products(torch.device("cuda", 0), torch.float16)
    may_check_products(torch.device("cuda", 0), torch.bfloat16)
    gpu = torch.device("cuda", 0)
    assert calls == [(gpu, torch.float16), (gpu, torch.bfloat16)]


def test_a_failed_check_is_not_remembered_as_passed(monkeypatch):
    def wrong(*a):
        raise DeviceCheckError("wrong")

    monkeypatch.setattr(device_check, "check_products", wrong)
    monkeypatch.setattr(device_check, "_CHECKED", set())
    for _ in range(2):
        with pytest.raises(DeviceCheckError):
            may_check_products(torch.device("cuda", 0), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_this_gpu_computes_the_checked_products_right(dtype):
    check_products(torch.device("cuda"), dtype)
