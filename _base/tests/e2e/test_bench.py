"""`pd bench` against `pd launch` (small numbers): its figures agree with the router's own
histograms (exact counts; means within the resolution of where each side takes its clock),
its result JSON and plot are written, and a JSONL dataset runs too."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


N, INPUT_LEN, OUTPUT_LEN = 8, 16, 6


@pytest.fixture(scope="module")
def launch(shared_launch):
    return shared_launch


def router_totals(url: str) -> dict[str, float]:
    """Sum of each router sample (role="router") by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.labels.get("role") == "router" and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def bench(launch, tiny_model_dir, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd", "bench", "--base-url", launch.url, "--tokenizer",
         str(tiny_model_dir), "--disable-progress", *extra],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_bench_agrees_with_router_histograms(launch, tiny_model_dir, tmp_path):
    before = router_totals(launch.url)
    r = bench(launch, tiny_model_dir, tmp_path, "--num-prompts", str(N), "--random-input-len",
              str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
              "--request-rate", "20", "--max-concurrency", "4", "--no-test-request",
              "--goodput", "ttft:60000", "tpot:60000", "--result-json", "out.json",
              "--plot", "cdf.png")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout and "P99 ITL (ms):" in r.stdout
    after = router_totals(launch.url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    res = json.loads((tmp_path / "out.json").read_text())
    assert (res["completed"], res["failed"]) == (N, 0)
    assert res["total_output_tokens"] == N * OUTPUT_LEN == d["pd_generation_tokens_total"]
    assert res["total_input_tokens"] == N * INPUT_LEN == d["pd_prompt_tokens_total"]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert d["pd_time_to_first_token_seconds_count"] == N == d["pd_e2e_request_latency_seconds_count"]
    # the router observes ITL per token; the bench per chunk, as vllm bench serve does, and a
    # token whose text is held back (a partial UTF-8 character) sends no chunk of its own
    num_itl = sum(len(x) for x in res["itls"])
    assert d["pd_inter_token_latency_seconds_count"] == N * (OUTPUT_LEN - 1) >= num_itl
    # the bench's clock starts before the HTTP request and stops when a chunk is read; the
    # router's starts on arrival and stops when it writes: the two agree within that gap
    for key, name in (("ttft", "pd_time_to_first_token_seconds"),
                      ("e2el", "pd_e2e_request_latency_seconds")):
        router_ms = 1000 * d[name + "_sum"] / d[name + "_count"]
        bench_ms = res[f"mean_{key}_ms"]
        assert abs(bench_ms - router_ms) <= 25 + 0.1 * router_ms, (key, bench_ms, router_ms)
    # per request, the ITL gaps add up to the time from the first token to the last either way
    router_ms = 1000 * d["pd_inter_token_latency_seconds_sum"] / N
    bench_ms = 1000 * sum(sum(x) for x in res["itls"]) / N
    assert abs(bench_ms - router_ms) <= 25 + 0.1 * router_ms, ("itl", bench_ms, router_ms)
    tpot = [(e - t) / (o - 1) for e, t, o in zip(res["e2els"], res["ttfts"], res["output_lens"])]
    assert res["mean_tpot_ms"] == pytest.approx(1000 * sum(tpot) / len(tpot))
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_split_among_client_processes(launch, tiny_model_dir, tmp_path):
    """--client-processes 2: every request once, concurrency shared, the same totals, and the
    per-request arrays in prompt order (lengths drawn from one seed, as one process has them)."""
    flags = ["--num-prompts", str(N), "--random-input-len", str(INPUT_LEN),
             "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "0.5",
             "--ignore-eos", "--max-concurrency", "3"]
    one = bench(launch, tiny_model_dir, tmp_path, *flags, "--result-json", "one.json")
    assert one.returncode == 0, one.stdout + one.stderr
    before = router_totals(launch.url)
    r = bench(launch, tiny_model_dir, tmp_path, *flags, "--client-processes", "2",
              "--result-json", "two.json")
    assert r.returncode == 0, r.stdout + r.stderr
    after = router_totals(launch.url)
    res = json.loads((tmp_path / "two.json").read_text())
    ref = json.loads((tmp_path / "one.json").read_text())
    assert (res["completed"], res["failed"], res["client_processes"]) == (N, 0, 2)
    assert res["input_lens"] == ref["input_lens"] and res["output_lens"] == ref["output_lens"]
    assert len(set(res["input_lens"])) > 1
    # the first process's test request (at most 4 tokens) is the only other traffic
    assert 0 <= after["pd_generation_tokens_total"] - before["pd_generation_tokens_total"] - (
        res["total_output_tokens"]) <= 4
    assert 0 < res["duration"] < sum(res["e2els"])


def test_bench_client_processes_share_the_load():
    import argparse

    from pd.cli.bench import add_arguments
    from pd.cli.bench_clients import split

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--max-concurrency", "7", "--request-rate", "9", "--seed", "5"])
    parts = split(args, list(range(10)), 3)
    assert [a.max_concurrency for a, _ in parts] == [3, 2, 2]
    assert [a.request_rate for a, _ in parts] == [3.0, 3.0, 3.0]
    assert [ps for _, ps in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [a.no_test_request for a, _ in parts] == [False, True, True]
    assert len({a.seed for a, _ in parts}) == 3 and args.max_concurrency == 7
    with pytest.raises(ValueError, match="cannot be shared"):
        split(args, list(range(10)), 8)
    with pytest.raises(ValueError, match="more than the 10 prompts"):
        split(p.parse_args([]), list(range(10)), 11)


def test_bench_jsonl_dataset_and_failures_counted(launch, tiny_model_dir, tmp_path):
    rows = [{"prompt": "def add(a, b):", "output_len": 3}, {"prompt": "import os\n"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    r = bench(launch, tiny_model_dir, tmp_path, "--dataset", "jsonl", "--dataset-path", "p.jsonl",
              "--num-prompts", "3", "--output-len", "2", "--ignore-eos", "--result-json", "j.json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "j.json").read_text())
    assert res["completed"] == 3 and res["output_lens"] == [3, 2, 3]
    # a model name the server does not serve: every request fails, none is counted as done
    r = bench(launch, tiny_model_dir, tmp_path, "--model", "no-such-model", "--num-prompts", "2",
              "--no-test-request", "--result-json", "f.json")
    res = json.loads((tmp_path / "f.json").read_text())
    assert r.returncode == 1 and (res["completed"], res["failed"]) == (0, 2)
    assert all(e.startswith("HTTP 404") for e in res["errors"]), res["errors"]
