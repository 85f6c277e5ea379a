"""Write prometheusrule.yaml from docker/monitoring/alerts.yml (the one source of the rules).

    python k8s/components/monitoring/render_prometheusrule.py

tests/test_alerts.py fails when the two differ, so run this after editing the rules.
"""

from pathlib import Path

import yaml

HERE = Path(__file__).parent
SOURCE = HERE.parents[2] / "docker/monitoring/alerts.yml"
HEADER = """\
# GENERATED from docker/monitoring/alerts.yml by render_prometheusrule.py: edit the source.
# The Prometheus Operator loads it; runbooks are in docs/ALERTS.md.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the PromQL expressions) as literal blocks, as in the source."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "ocr-cache"},
        "spec": yaml.safe_load(SOURCE.read_text()),
    }
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)


if __name__ == "__main__":
    (HERE / "prometheusrule.yaml").write_text(render())
