"""Alerting, tested for real: `promtool` (Debian's prometheus package, unpacked into the venv by
`make install-tools`) checks docker/monitoring/alerts.yml and runs its unit tests on synthetic
series; the Kubernetes PrometheusRule carries the same groups; every alert has a runbook; and
the gauges the rules read move on a live app when Redis dies and when the engine fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.embedded_redis import EmbeddedRedis
from tests.conftest import ROOT, SHORT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import FlakyEngine, b64, metric_sum

pytestmark = pytest.mark.deploy

MONITORING = ROOT / "docker/monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts.test.yml"
COMPONENT = ROOT / "k8s/components/monitoring"
RUNBOOKS = ROOT / "docs/ALERTS.md"


def _promtool() -> str:
    local = Path(sys.executable).parent / "promtool"
    found = str(local) if local.exists() else shutil.which("promtool")
    if not found:
        pytest.skip("promtool not found: `make install-tools` could not unpack Debian's prometheus")
    return found


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_rules_are_valid_promql() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    """Each alert fires on the synthetic series of its failure and stays quiet otherwise."""
    result = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=MONITORING,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, quiet = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in _alerts()}
    assert names - firing == set(), "alerts never shown to fire"
    # Every alert except the plain "target down" one has a case where it must stay quiet.
    assert names - quiet <= {"OcrFrontDown", "OcrEngineDown"}, "alerts never shown to stay quiet"


def test_a_broken_rule_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: a tenth of the hit-ratio threshold, and the drop case is quiet."""
    broken = RULES.read_text().replace("< 0.5 * ocr:", "< 0.05 * ocr:")
    assert broken != RULES.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts.test.yml").write_text(RULE_TESTS.read_text())
    result = subprocess.run(
        [_promtool(), "test", "rules", "alerts.test.yml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "OcrCacheHitRatioDrop" in result.stdout + result.stderr


def test_every_alert_has_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9-]", "", line[3:].strip().lower().replace(" ", "-"))
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    }
    for rule in _alerts():
        runbook = rule["annotations"]["runbook"]
        assert runbook == f"docs/ALERTS.md#{rule['alert'].lower()}", rule["alert"]
        assert rule["alert"].lower() in anchors, f"docs/ALERTS.md has no section {rule['alert']}"
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_rules_read_only_metrics_that_exist() -> None:
    """ocr_* from app/metrics.py; redis_* from redis_exporter, which both deployments run."""
    declared = set(re.findall(r'"(ocr_[a-z0-9_]+)"', (ROOT / "app/metrics.py").read_text()))
    groups = yaml.safe_load(RULES.read_text())["groups"]
    exprs = "\n".join(rule["expr"] for group in groups for rule in group["rules"])
    used = set(re.findall(r"\b(ocr_[a-z0-9_]+)", exprs))
    for name in used:
        assert re.sub(r"_(bucket|sum|count)$", "", name) in declared, name
    exporter = set(re.findall(r"\b(redis_[a-z_]+)", exprs))
    assert exporter <= {
        "redis_up",
        "redis_memory_used_bytes",
        "redis_memory_max_bytes",
        "redis_evicted_keys_total",
    }


def test_prometheusrule_carries_the_same_groups() -> None:
    sys.path.insert(0, str(COMPONENT))
    try:
        import render_prometheusrule
    finally:
        sys.path.remove(str(COMPONENT))
    committed = (COMPONENT / "prometheusrule.yaml").read_text()
    assert committed == render_prometheusrule.render(), "run render_prometheusrule.py"
    rule = yaml.safe_load(committed)
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_monitoring_overlay_renders_with_rules_and_scrapes() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found (it renders the kustomize overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "k8s/overlays/monitoring")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("PrometheusRule", "ocr-cache") in kinds
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    for monitor, name in (("ocr-cache-front", "ocr-cache"), ("ocr-cache-engine", "ocr-engine")):
        pod = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
        containers = pod["spec"]["template"]["spec"]["containers"]
        ports = {p["name"] for c in containers for p in c["ports"]}
        assert monitors[monitor]["spec"]["podMetricsEndpoints"][0]["port"] in ports, monitor
    jobs = {
        m["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["replacement"]
        for m in monitors.values()
    }
    # What the rules select on (job="ocr-cache": the fronts), and the engines' own job.
    assert jobs == {"ocr-cache", "ocr-engine", "redis"}
    # The standard objects still validate strictly (the CRDs have no schema there).
    validate = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--quiet"]
        + ["-k", "1.32.0", "-"],
        input=out.stdout,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr


def test_compose_prometheus_loads_the_rules() -> None:
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    compose = (ROOT / "docker/docker-compose.yml").read_text()
    assert "./monitoring/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose


def _gauge(client, name: str) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(client.get("/metrics").get_data(as_text=True), name)


def test_breaker_gauge_follows_redis(make_app) -> None:  # type: ignore[no-untyped-def]
    server = EmbeddedRedis().start()
    try:
        client = make_app(
            redis_url=server.url, redis_breaker_failures=2, redis_breaker_cooldown_seconds=0.2
        ).test_client()
        assert client.post("/v1/ocr", json={"image": b64(SHORT.read_bytes())}).status_code == 200
        assert _gauge(client, "ocr_redis_breaker_open") == 0
        server.stop()
        for _ in range(3):
            resp = client.post("/v1/ocr", json={"image": b64(SHORT.read_bytes())})
            assert resp.status_code == 200
        assert _gauge(client, "ocr_redis_breaker_open") == 1
        server.start()  # same port, same directory

        def closed_again() -> bool:
            client.post("/v1/ocr", json={"image": b64(SHORT.read_bytes())})
            return _gauge(client, "ocr_redis_breaker_open") == 0

        wait_for(closed_again, 60, "the breaker gauge back to 0 once Redis answered again")
    finally:
        server.cleanup()


def test_engine_ready_gauge_follows_the_engine(make_app, engine) -> None:  # type: ignore[no-untyped-def]
    flaky = FlakyEngine(engine)
    failing = flaky.failing

    client = make_app(engine_override=flaky, engine_unready_after_failures=2).test_client()
    wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready",
             lambda: str(client.get("/readyz").get_json()))  # fmt: skip
    assert _gauge(client, "ocr_engine_ready") == 1
    failing.set()
    for path in (WORD_EN, WORD_CH):
        assert client.post("/v1/ocr", json={"image": b64(path.read_bytes())}).status_code == 503
    assert _gauge(client, "ocr_engine_ready") == 0
    failing.clear()
    # Broken at 2 failures in a row, its feeders take no more tickets (an engine process would
    # exit for a restart); a direct call (no-cache) still reaches it, and succeeds.
    body = {"image": b64(WORD_EN.read_bytes())}
    again = client.post("/v1/ocr", json=body, headers={"Cache-Control": "no-cache"})
    assert again.status_code == 200
    assert _gauge(client, "ocr_engine_ready") == 1
