"""What the deployment tests share: the Prometheus binaries (installed from Debian's registry when
missing, or a loud skip where that cannot be done), the metric names the services export, and
the `pd` argument parser for checking the flags written in manifests and unit files."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_install_tried: list[str] = []


def prometheus_bins() -> tuple[str, str]:
    """(prometheus, promtool) paths; installs the Debian package `prometheus` when missing."""
    if not (shutil.which("prometheus") and shutil.which("promtool")) and not _install_tried:
        _install_tried.append("yes")
        why = ""
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            why = "not root or no apt-get"
        else:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            r = subprocess.run("apt-get update -qq && apt-get install -y -qq prometheus", shell=True,
                               env=env, capture_output=True, text=True, timeout=600)
            why = r.stderr[-2000:] if r.returncode else ""
        if why:
            _install_tried.append(why)
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        reason = _install_tried[-1] if len(_install_tried) > 1 else "install failed"
        pytest.skip("!!! PROMETHEUS IS NOT INSTALLED AND COULD NOT BE INSTALLED "
                    f"(apt-get install prometheus): {reason}")
    return prom, tool


def exported_metric_names() -> set[str]:
    """Every sample name the router and the nodes can export (histograms' _bucket/_sum/_count,
    counters' _total), from the metric definitions themselves."""
    import prometheus_client

    import pd.service.metrics  # noqa: F401  (defines the node metrics)
    import pd.service.node  # noqa: F401
    import shm_ipc.metrics  # noqa: F401
    from router import metrics as router_metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("_sum", "_count")}
    names: set[str] = set()
    registries = (prometheus_client.REGISTRY, router_metrics.RouterMetrics().registry,
                  router_metrics._PROCESS)
    for registry in registries:
        for family in registry.collect():
            if family.name.startswith("pd_"):
                names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bpd_[a-z0-9_]+", expr))


def parse_pd_args(argv: list[str]):
    """Parse `pd ARGV...` with the real parser; a bad flag fails the test with pd's message."""
    from pd.cli.main import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"pd {' '.join(argv)}: {err.getvalue().strip()}")
