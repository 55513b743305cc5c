"""`pd bench`'s figures on hand-built request outcomes: TPOT excludes the first token and
single-token requests, ITL pools every gap, goodput needs every SLO, failures are not averaged."""

from __future__ import annotations

import numpy as np
import pytest

from pd.cli.bench_report import RequestOutput, parse_goodput, summarize, table


def outcome(ttft, gaps, n_out, ok=True):
    return RequestOutput(success=ok, prompt_len=10, output_len=n_out, ttft=ttft, itl=list(gaps),
                         latency=ttft + sum(gaps))


def test_summary_meanings():
    outs = [outcome(0.1, [0.02, 0.04], 3), outcome(0.3, [], 1), outcome(0.2, [0.05], 2),
            outcome(9.0, [1.0], 2, ok=False)]
    s = summarize(outs, duration=2.0, percentiles=[50, 90], goodput={"ttft": 250, "tpot": 45})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.0
    # TPOT over requests with >1 token: (0.06)/2 and 0.05/1
    assert s["mean_tpot_ms"] == pytest.approx((30 + 50) / 2)
    assert s["mean_itl_ms"] == pytest.approx((20 + 40 + 50) / 3)
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile([100, 300, 200], 90))
    assert s["median_e2el_ms"] == pytest.approx(250)
    # TTFT <= 250 ms and TPOT <= 45 ms: only the first request (the second is slow to start,
    # the third's TPOT is 50 ms)
    assert s["request_goodput"] == pytest.approx(1 / 2.0)
    loose = summarize(outs, duration=2.0, percentiles=[50], goodput={"ttft": 400})
    assert loose["request_goodput"] == pytest.approx(3 / 2.0)
    text = table(s, [50, 90])
    assert "Request goodput (req/s):" in text and "P90 TTFT (ms):" in text


def test_goodput_parsing_refuses_bad_input():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
