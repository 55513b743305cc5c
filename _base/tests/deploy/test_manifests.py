"""The Kubernetes manifests, validated offline: every object against the bundled API schemas
(kubernetes-validate, strict), the base and the example overlay as kustomize would build them,
and every container's command line through pd's own argument parser."""

from __future__ import annotations

import copy
import re
import shlex

import kubernetes_validate
import pytest
import yaml

from tests.deploy.deploy_files import DEPLOY, parse_pd_args

K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"


def load(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(base, patch):
    """A strategic merge as kustomize does it for these patches: maps merge, lists of named
    items merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            i = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if i is None:
                out.append(item)
            else:
                out[i] = merge(out[i], item)
        return out
    return patch


def build(directory) -> list[dict]:
    """The objects `kustomize build DIRECTORY` makes (for the fields these files use)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objs: list[dict] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml names {res}, which is missing"
        objs += build(path) if path.is_dir() else load(path)
    for p in kust.get("patches", []):
        for patch in load(directory / p["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, o in enumerate(objs) if (o["kind"], o["metadata"]["name"]) == key]
            assert len(hits) == 1, f"patch {p['path']} matches {len(hits)} objects for {key}"
            objs[hits[0]] = merge(objs[hits[0]], patch)
    for obj in objs:
        for lab in kust.get("labels", []):
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
        if "namespace" in kust and obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = kust["namespace"]
        for c in containers(obj):
            for img in kust.get("images", []):
                if c["image"].split(":")[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img.get('newTag', 'latest')}"
    return objs


def containers(obj: dict) -> list[dict]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def command_line(obj: dict, c: dict, config: dict) -> list[str]:
    """The container's pd argv, with $(VAR) (Kubernetes) and $VAR (shell) expanded."""
    env = {**config, **{e["name"]: f"<{e['name']}>" for e in c.get("env", [])}}
    if c.get("command", [])[:2] == ["/bin/sh", "-c"]:
        line = re.sub(r'"?\$\{?(\w+)\}?"?', lambda m: env[m.group(1)], c["args"][0])
        argv = shlex.split(line)
        assert argv[:2] == ["exec", "pd"], line
        return argv[2:]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]


@pytest.mark.parametrize("name", ["base", "overlays/example"])
def test_kustomization_builds_valid_objects(name):
    objs = build(K8S / name)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for want in [("Deployment", "pd-router"), ("StatefulSet", "pd-prefill"),
                 ("StatefulSet", "pd-decode"), ("Service", "pd-router"), ("Service", "pd-prefill"),
                 ("Service", "pd-decode"), ("ConfigMap", "pd-config")]:
        assert want in kinds
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD: no bundled schema; checked below
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("name", ["base", "overlays/example"])
def test_containers_run_real_pd_commands_with_probes_and_scrape_ports(name):
    objs = build(K8S / name)
    config = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    headless = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"
                and o["spec"].get("clusterIP") == "None"}
    for obj in objs:
        for c in containers(obj):
            args = parse_pd_args(command_line(obj, c, config))
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert c["readinessProbe"] and c["livenessProbe"]
            probe_port = c["readinessProbe"]["httpGet"]["port"]
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert int(annotations["prometheus.io/port"]) == ports[probe_port]
            if args.command in ("prefill", "decode"):
                assert args.metrics_port == ports["metrics"] and args.port == ports["control"]
                assert "nvidia.com/gpu" in c["resources"]["requests"]
                assert obj["kind"] == "StatefulSet" and obj["spec"]["serviceName"] in headless
            # every pd process takes the deployment's CURVE keys from the Secret's mount (nodes
            # on the pod network refuse to start without them)
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
            secret = volumes[mounts[config["PD_CURVE_KEYS"]]]["secret"]
            assert secret["secretName"] == "pd-curve-keys" and not getattr(args, "insecure", False)
            if args.command == "decode":
                assert args.kv_port == ports["kv"] and args.host == "<POD_IP>"
            if args.command == "prefill":
                assert args.transport == "zmq"  # pods never share a ring
            if args.command == "router":
                assert args.port == ports["http"]
                # the nodes the router lists are the StatefulSets' pods by their DNS names
                sets = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objs
                        if o["kind"] == "StatefulSet"}
                for role, addrs in (("prefill", args.prefill), ("decode", args.decode)):
                    want = {f"pd-{role}-{i}.pd-{role}:{7100 if role == 'prefill' else 7200}"
                            for i in range(sets[f"pd-{role}"])}
                    assert set(addrs) == want


def test_servicemonitor_selects_the_services_and_their_metrics_ports():
    objs = build(K8S / "overlays/example")
    sm = next(o for o in objs if o["kind"] == "ServiceMonitor")
    sel = sm["spec"]["selector"]["matchLabels"]
    services = [o for o in objs if o["kind"] == "Service"]
    picked = [s for s in services if sel.items() <= s["metadata"].get("labels", {}).items()]
    assert {s["metadata"]["name"] for s in picked} == {"pd-router", "pd-prefill", "pd-decode"}
    endpoint_ports = {e["port"] for e in sm["spec"]["endpoints"]}
    for s in picked:
        assert endpoint_ports & {p["name"] for p in s["spec"]["ports"]}, s["metadata"]["name"]


def test_a_broken_manifest_is_refused():
    bad = copy.deepcopy(next(o for o in build(K8S / "base") if o["kind"] == "StatefulSet"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
