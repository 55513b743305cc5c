"""The systemd unit templates: each runs a real `pd` command whose flags pd accepts, with the
variables its EnvironmentFiles (the examples under deploy/systemd/env) define."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.deploy.deploy_files import DEPLOY, parse_pd_args

SYSTEMD = DEPLOY / "systemd"
UNITS = {"pd-prefill@.service": ("prefill-0", "prefill"), "pd-decode@.service": ("decode-0", "decode"),
         "pd-router.service": ("", "router")}


def unit_entries(path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def env_file(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line and not line.startswith("#"))


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unit_runs_a_valid_pd_command(unit):
    instance, command = UNITS[unit]
    e = unit_entries(SYSTEMD / unit)
    env: dict[str, str] = {}
    for f in e["EnvironmentFile"]:
        name = f.replace("/etc/pd/", "").replace("%i", instance)
        env.update(env_file(SYSTEMD / "env" / name))
    line = e["ExecStart"][0].replace("%i", instance)
    missing = set(re.findall(r"\$\{?(\w+)", line)) - set(env)
    assert not missing, f"{unit} uses {missing}, which its EnvironmentFiles do not set"
    # ${VAR} is one word, $VAR splits on whitespace (systemd.service(5))
    line = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(env[m.group(1)]), line)
    line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
    argv = shlex.split(line)
    assert argv[0].endswith("/pd") and argv[1] == command
    args = parse_pd_args(argv[1:])
    assert e["Restart"] == ["on-failure"] and e["KillSignal"] == ["SIGTERM"]
    if command in ("prefill", "decode"):
        assert args.metrics_port is not None and args.node_id == instance
        assert args.host not in ("0.0.0.0", "127.0.0.1") or command == "prefill"
        # a node on a network address starts only with the deployment's keys
        from pd.wire.security import is_loopback
        assert is_loopback(args.host) or env.get("PD_CURVE_KEYS") or args.insecure
