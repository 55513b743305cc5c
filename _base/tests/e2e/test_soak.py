"""A short soak through `pd launch` on the tiny model (benchmarks/soak.py, small): every streamed
completion equals single-process generation, and pushed past the router's bounded queue the
excess is answered 429 while the waiting gauge stays within --max-queue. RSS is sampled and
printed by the benchmark, not judged here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("pd_soak_benchmark", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_short_soak_all_correct_and_overload_answers_429(tiny_model_dir):
    soak = load_soak()
    args = soak.parse_args(["--model", str(tiny_model_dir), "--requests", "200",
                            "--concurrency", "48", "--max-tokens", "16", "--max-running", "48",
                            "--max-queue", "32", "--overload", "200", "--sample-interval", "1",
                            "--request-timeout", "60", "--launch-args", "--num-blocks 512"])
    report = soak.run(args)
    soak.print_report(report, args)
    assert soak.checks(report, args) == []
    s, o = report["soak"], report["overload"]
    assert s.correct == 200 and s.refused == 0 and not s.errors
    assert o.refused > 0 and o.correct + o.refused == 200 and not o.errors and o.wrong == 0
    assert o.correct >= 48  # the ones that fit were served
    assert 0 < o.max_waiting <= 32
    assert all(report["alive"].values())
    assert len(report["pids"]) == 3  # router, prefill, decode
