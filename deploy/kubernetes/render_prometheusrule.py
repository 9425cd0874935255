"""Writes prometheusrule.yaml: deploy/prometheus-alerts.yaml's rule groups as a Prometheus
Operator PrometheusRule (one source for both; tests/python/deploy checks they agree).

    python deploy/kubernetes/render_prometheusrule.py
"""

import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "..", "prometheus-alerts.yaml")
OUT = os.path.join(HERE, "prometheusrule.yaml")
HEADER = ("# Generated from deploy/prometheus-alerts.yaml by render_prometheusrule.py: edit that "
          "file and rerun.\n")


def _block_strings(dumper, s):
    style = "|" if "\n" in s else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, _block_strings)


def render() -> str:
    with open(RULES) as f:
        groups = yaml.safe_load(f)["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "pyspec", "labels": {"app.kubernetes.io/name": "pyspec"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)


if __name__ == "__main__":
    with open(OUT, "w") as f:
        f.write(render())
    sys.stdout.write(f"wrote {OUT}\n")
