"""Shared pytest fixtures: tiny model directories written by `pd.testing.tiny`.

`tiny_model_dir` is the default (Llama + MTP) checkpoint; `make_tiny_model(**kwargs)` writes
any other variant with `write_tiny_checkpoint`'s keyword arguments, once per distinct set of
arguments per test session. Tests must treat these directories as read-only.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Callable

import pytest

from pd.testing.tiny import write_tiny_checkpoint

# every engine of the suite, in this process and in the nodes it starts, walks its whole block
# allocator each time it goes idle, not only its counts (`pd.engine.engine.Engine.step`)
os.environ.setdefault("PD_CHECK_INTEGRITY", "1")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}
    signature = inspect.signature(write_tiny_checkpoint)

    def make(arch: str = "llama", **kwargs) -> Path:
        # defaults filled in, so make() and make(mtp=True) share one directory
        bound = signature.bind(None, arch, **kwargs)
        bound.apply_defaults()
        args = {k: v for k, v in bound.arguments.items() if k != "path"}
        key = json.dumps(args, sort_keys=True, default=repr)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = write_tiny_checkpoint(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model) -> Path:
    return make_tiny_model("llama", mtp=True)
