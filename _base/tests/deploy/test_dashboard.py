"""The Grafana dashboard loads, and every panel's queries name metrics the services export."""

from __future__ import annotations

import json

from tests.deploy.deploy_files import DEPLOY, exported_metric_names, metric_names_in

WANTED = ("pd_time_to_first_token_seconds_bucket", "pd_inter_token_latency_seconds_bucket",
          "pd_generation_tokens_total", "pd_kv_cache_usage_perc",
          "pd_spec_decode_num_accepted_tokens_total", "pd_decode_step_gap_seconds_bucket")


def test_dashboard_queries_name_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "pd-dashboard.json").read_text())
    exported = exported_metric_names()
    assert dash["panels"] and dash["uid"]
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            names = metric_names_in(t["expr"])
            assert names, f"{panel['title']}: {t['expr']} names no pd metric"
            assert names <= exported, f"{panel['title']}: {names - exported} are not exported"
            used |= names
    # TTFT, ITL, throughput, KV usage, acceptance, step gap: the list
    assert set(WANTED) <= used


def test_exported_names_come_from_definitions():
    names = exported_metric_names()
    assert "pd_time_to_first_token_seconds_bucket" in names
    assert "pd_kv_cache_usage_perc" in names and "pd_ring_records_refused_total" in names
    assert "pd_no_such_metric" not in names
