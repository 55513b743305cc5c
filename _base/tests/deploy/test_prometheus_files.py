"""The shipped Prometheus config and alert rules pass promtool, and each alert fires on the
series that should fire it (deploy/prometheus/alerts_test.yml)."""

from __future__ import annotations

import subprocess

import yaml

from tests.deploy.deploy_files import DEPLOY, exported_metric_names, metric_names_in, prometheus_bins

PROM = DEPLOY / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    _, tool = prometheus_bins()
    return subprocess.run([tool, *args], cwd=PROM, capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules():
    r = promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 6 rules found" in r.stdout + r.stderr


def test_alerts_fire_on_their_series():
    r = promtool("test", "rules", "alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_names_exported_metrics_and_is_tested():
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"][0]["rules"]
    exported = exported_metric_names()
    for rule in rules:
        assert metric_names_in(rule["expr"]) <= exported, rule["alert"]
    tested = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"][0]["alert_rule_test"]
    assert {r["alert"] for r in rules} == {t["alertname"] for t in tested}
