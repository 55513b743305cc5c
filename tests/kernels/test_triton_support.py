"""`pd_kernels.triton_support.triton_usable`: which kernels `PD_TRITON` and `PD_TRITON_OFF`
leave to their torch twins (the switches `benchmarks/gpu/check_sm_share.py --switches` walks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pd_kernels import triton_support
from pd_kernels.triton_support import triton_usable

ON_CUDA = SimpleNamespace(is_cuda=True)  # all the function reads of a tensor


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.setattr(triton_support, "triton_importable", lambda: True)
    monkeypatch.delenv("PD_TRITON", raising=False)
    monkeypatch.delenv("PD_TRITON_OFF", raising=False)


def test_every_kernel_by_default_and_none_on_the_cpu():
    assert triton_usable(ON_CUDA) and triton_usable(ON_CUDA, "rms_norm")
    assert not triton_usable(torch.zeros(1), "rms_norm")


def test_named_kernels_go_to_their_twins(monkeypatch):
    monkeypatch.setenv("PD_TRITON_OFF", "rms_norm,argmax")
    assert not triton_usable(ON_CUDA, "rms_norm") and not triton_usable(ON_CUDA, "argmax")
    assert triton_usable(ON_CUDA, "masked_argmax") and triton_usable(ON_CUDA, "activation")


def test_pd_triton_0_turns_every_one_off(monkeypatch):
    monkeypatch.setenv("PD_TRITON", "0")
    assert not triton_usable(ON_CUDA) and not triton_usable(ON_CUDA, "skinny_linear")


def test_without_triton_nothing_is_usable(monkeypatch):
    monkeypatch.setattr(triton_support, "triton_importable", lambda: False)
    assert not triton_usable(ON_CUDA, "rms_norm")
