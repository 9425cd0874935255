"""deploy/kubernetes: every built-in object valid against the Kubernetes API schemas (strict: an
unknown field fails), and the manifests consistent with each other and with the server they run
(its flags parse, probes hit its health endpoints, the grace period covers its drain, the config
it mounts loads, the autoscaler's metric is one it exports, the alert rules are the shipped ones).
No cluster runs here: this is what can be checked without one."""

import os
import posixpath

import pytest

from helpers import require_module

require_module("kubernetes_validate")
require_module("yaml")

import yaml  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
K8S = os.path.join(ROOT, "deploy", "kubernetes")
# The oldest Kubernetes the manifests are written for (autoscaling/v2, policy/v1 are GA there) and
# the newest the schema package knows.
VERSIONS = ("1.29", "1.37")
CRDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator kinds: checked by hand below


def _manifests():
    out = {}
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml") and name != "kustomization.yaml":
            with open(os.path.join(K8S, name)) as f:
                docs = [d for d in yaml.safe_load_all(f) if d]
            assert len(docs) == 1, f"{name}: one object per file"
            out[name] = docs[0]
    return out


@pytest.fixture(scope="module")
def objs():
    return {o["kind"]: o for o in _manifests().values()}


@pytest.fixture(scope="module")
def container(objs):
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def args(container):
    """The container's command line, parsed by `pyspec serve`'s own parser and checked as the
    server checks it before loading anything."""
    require_module("prometheus_client")
    from pyspec.serve.cli import parse_serve_flags

    assert container["command"] == ["pyspec"] and container["args"][0] == "serve"
    a = parse_serve_flags(container["args"][1:])
    return a


def test_every_manifest_is_listed_and_valid_against_the_api_schema():
    import jsonschema
    import kubernetes_validate

    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        listed = yaml.safe_load(f)["resources"]
    found = _manifests()
    assert sorted(listed) == sorted(found), "kustomization.yaml must list every manifest"
    kinds = {o["kind"] for o in found.values()}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"} | CRDS <= kinds
    errors = []
    for name, obj in found.items():
        if obj["kind"] in CRDS:
            continue
        for v in VERSIONS:
            try:
                kubernetes_validate.validate(obj, v, strict=True)
            except jsonschema.ValidationError as e:
                path = "/".join(str(p) for p in e.absolute_path)
                errors.append(f"{name} against Kubernetes {v}: {path}: {e.message}")
    assert not errors, "\n".join(errors)


def test_schema_check_catches_a_misspelt_field(objs):
    """The check above can fail: a probe field misspelt is refused."""
    import copy

    import jsonschema
    import kubernetes_validate

    bad = copy.deepcopy(objs["Deployment"])
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["periodSecond"] = c["readinessProbe"].pop("periodSeconds")
    with pytest.raises(jsonschema.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def test_selectors_and_ports_agree(objs, container, args):
    dep, svc = objs["Deployment"], objs["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() \
        <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] in ports
    sm = objs["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["endpoints"]] == [sp["name"]]
    assert sm["endpoints"][0]["path"] == "/metrics"
    hpa = objs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", dep["metadata"]["name"])


def test_probes_hit_the_public_health_endpoints(container, args):
    """Probes and the scraper send no API key: their paths must be public."""
    public = set(args.public_endpoints.split(","))
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/ready")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "http"), probe
        assert path in public, f"{probe}: {path} needs --public-endpoints"
    assert "/metrics" in public, "the ServiceMonitor scrapes without a key"
    assert args.host == "0.0.0.0"


def test_grace_period_covers_the_drain(objs, container, args):
    """SIGKILL must not come before the server's drain ends: the grace period (which the
    preStop hook spends first) >= preStop + --drain-timeout + 5 s, as docs/operating.md says."""
    grace = objs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    assert grace >= float(cmd[1]) + args.drain_timeout + 5


def test_mounted_config_loads_and_is_watched(objs, container, args):
    """The ConfigMap is mounted as a folder (a subPath mount never sees an edit), at the folder
    of --config, holds that file, and the file is a valid serve config."""
    from pyspec.serve.config import parse_config

    (mount,) = container["volumeMounts"]
    assert "subPath" not in mount
    assert mount["mountPath"] == posixpath.dirname(args.config)
    (vol,) = [v for v in objs["Deployment"]["spec"]["template"]["spec"]["volumes"]
              if v["name"] == mount["name"]]
    cm = objs["ConfigMap"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    text = cm["data"][posixpath.basename(args.config)]
    parse_config(yaml.safe_load(text))
    assert args.watch_config and args.watch_config > 0


def test_autoscaler_metric_is_exported(objs):
    from pyspec.serve.metrics import Metrics

    (m,) = objs["HorizontalPodAutoscaler"]["spec"]["metrics"]
    name = m["pods"]["metric"]["name"]
    exported = {s.name for fam in Metrics().registry.collect() for s in fam.samples}
    assert name in exported


def test_prometheus_rule_is_the_shipped_alert_file():
    """prometheusrule.yaml is generated from deploy/prometheus-alerts.yaml; they must agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "render_prometheusrule", os.path.join(K8S, "render_prometheusrule.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(K8S, "prometheusrule.yaml")) as f:
        assert f.read() == mod.render(), \
            "stale: run python deploy/kubernetes/render_prometheusrule.py"
