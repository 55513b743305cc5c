"""`pd.service.metrics`: a node's process times its garbage collections of generations 1 and 2
(`pd_gc_pause_seconds`), the pauses in which its Python does nothing else."""

from __future__ import annotations

import gc

from prometheus_client import REGISTRY

from pd.service import metrics


def sample(name: str, generation: str) -> float:
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("generation") == generation:
                return s.value
    return 0.0


def test_a_full_collection_is_timed_and_a_young_one_is_not():
    metrics.for_node("decode", "gc-test")
    metrics.for_node("decode", "gc-test-2")  # once a process: no second callback
    assert sum(cb.__name__ == "on_gc" for cb in gc.callbacks) == 1
    before = {g: sample("pd_gc_pause_seconds_count", g) for g in ("0", "1", "2")}
    seconds = sample("pd_gc_pause_seconds_sum", "2")
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    after = {g: sample("pd_gc_pause_seconds_count", g) for g in ("0", "1", "2")}
    assert after["2"] - before["2"] == 2 and after["0"] == before["0"] == 0
    assert sample("pd_gc_pause_seconds_sum", "2") > seconds
