"""The compose stack's metrics: deploy/prometheus.yml and every query of the Grafana
dashboard (deploy/grafana/dashboards/tandem.json) checked by the real promtool, and the
dashboard's structure and data source wired to what Grafana is provisioned with. The same
for `tandem up`'s (deploy/observability/prometheus.yml and its Grafana data source; the
targets file the launcher writes for it: tests/unit/test_prometheus_targets.py).
(tests/e2e/test_dashboard_metrics.py checks every metric it reads is one the processes
serve.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tools import missing_tool

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tandem.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
# `tandem up`'s: deploy/observability/compose.yaml
OBSERVABILITY = ROOT / "deploy" / "observability"
UP_PROMETHEUS = OBSERVABILITY / "prometheus.yml"
UP_DATASOURCES = OBSERVABILITY / "grafana" / "datasources" / "prometheus.yml"


def promtool() -> str:
    found = shutil.which("promtool") or str(ROOT / ".tools" / "promtool")
    if not os.access(found, os.X_OK):
        missing_tool("promtool not found (on PATH or in .tools/; .ci/run fetches it)")
    return found


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def expressions() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


@pytest.mark.parametrize("config", [PROMETHEUS, UP_PROMETHEUS], ids=["compose", "tandem-up"])
def test_prometheus_config_passes_promtool(config: Path) -> None:
    out = subprocess.run(
        [promtool(), "check", "config", str(config)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Each panel's PromQL as a recording rule, so promtool's parser reads every one
    (Grafana's `$__rate_interval` stands in as 1m)."""
    rules = [
        {"record": f"tandem:dashboard_query_{i}", "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(expressions())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout


def dashboard_labels() -> set[str]:
    """The labels the dashboard reads: those it groups by and those its legends show."""
    out = {"le"}  # every histogram_quantile's
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            for group in re.findall(r"\bby \(([^)]*)\)", target["expr"]):
                out |= {label.strip() for label in group.split(",")}
            out |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
    return out


def test_tandem_up_prometheus_keeps_every_label_the_dashboard_reads() -> None:
    """The samples reach the dashboard as the processes label them: no relabelling of
    samples, no target relabelling onto a label the dashboard reads, and `instance` left to
    Prometheus (the address), as deploy/prometheus.yml leaves it. The targets' own labels
    (the launcher's file) are checked against the same set in test_prometheus_targets.py."""
    labels = dashboard_labels()
    assert {"instance", "endpoint", "outcome", "direction", "le"} <= labels  # the parse works
    for path in (PROMETHEUS, UP_PROMETHEUS):
        for job in yaml.safe_load(path.read_text())["scrape_configs"]:
            assert "metric_relabel_configs" not in job, (path, job["job_name"])
            assert not job.get("honor_labels"), (path, job["job_name"])
            for rule in job.get("relabel_configs", []):
                assert rule.get("target_label") not in labels, (path, rule)
                assert rule.get("action", "replace") in ("replace", "keep"), (path, rule)
    up = yaml.safe_load(UP_PROMETHEUS.read_text())["scrape_configs"]
    assert [list(job) for job in up] == [["job_name", "file_sd_configs"]]  # file_sd alone


def test_tandem_up_grafana_reads_its_prometheus_under_the_dashboards_uid() -> None:
    """deploy/observability's Grafana shares the host's network: its data source is the
    Prometheus on the loopback, under the uid the dashboard names."""
    compose_uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    (source,) = yaml.safe_load(UP_DATASOURCES.read_text())["datasources"]
    assert source["uid"] == compose_uid and source["isDefault"] and source["type"] == "prometheus"
    assert source["url"] == "http://127.0.0.1:${PROMETHEUS_PORT}"


def test_dashboard_structure_and_data_source() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["panels"]
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and (pos["x"], pos["y"]) not in cells
        cells.add((pos["x"], pos["y"]))
        assert panel["datasource"]["uid"] == uid and panel["title"] and panel["description"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert all(t["datasource"]["uid"] == uid for t in panel["targets"])


# What the issue asks the dashboard to show, by a metric each reads.
WANTED = {
    "request rate": "tandem_requests_total",
    "TTFT": "tandem_time_to_first_token_seconds_bucket",
    "ITL": "tandem_inter_token_latency_seconds_bucket",
    "E2E": "tandem_e2e_request_latency_seconds_bucket",
    "batch": "tandem_decode_running_sequences",
    "KV use": "tandem_kv_blocks_used",
    "prefill backlog": "tandem_prefill_queue_depth",
    "KV transfer rate": "tandem_kv_transfer_bytes_total",
    "prefix-cache hit rate": "tandem_prefix_cache_hit_tokens_total",
    "failovers": "tandem_failovers_total",
    "checkpoint lag": "tandem_checkpoint_lag_tokens",
}


def metric_names() -> set[str]:
    return {m for e in expressions() for m in re.findall(r"\btandem_[a-z0-9_]+", e)}


def test_the_dashboard_shows_what_operators_need() -> None:
    names = metric_names()
    missing = {what: m for what, m in WANTED.items() if m not in names}
    assert not missing
