"""`tandem up --prometheus-targets FILE` as a user runs it: every target FILE lists answers
/metrics, no target label takes one of the samples' labels (Prometheus would rename the
sample's to exported_*), and Ctrl-C removes FILE. (What the file says and when it changes:
tests/unit/test_prometheus_targets.py.)"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.server import free_port
from tests.e2e.test_up import complete_once, start_up, stop, wait_ready

pytestmark = pytest.mark.e2e


def complete(port: int) -> None:
    """One request: the router's labelled counters (per node, per route) get samples."""
    assert complete_once(port, 4)["usage"]["completion_tokens"] == 4


def sample_labels(address: str) -> set[str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    families = list(text_string_to_metric_families(text))
    assert families, address
    return {label for f in families for s in f.samples for label in s.labels}


def test_every_listed_target_serves_metrics_and_the_file_goes_at_ctrl_c(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    targets = tmp_path / "metrics" / "targets.json"
    port = free_port()
    argv = ["--model", str(tiny_model_dir), "--port", str(port), "--transport", "tcp"]
    argv += ["--split", "--kvcache", "0", "--prometheus-targets", str(targets)]
    log = tmp_path / "up.log"
    up = start_up(argv, log)
    try:
        wait_ready(up, log)
        complete(port)
        groups: list[dict[str, Any]] = json.loads(targets.read_text())
        by_node = {g["labels"].get("node", g["labels"]["job"]): g for g in groups}
        assert sorted(by_node) == ["decode-1", "prefill-1", "router"]
        assert by_node["router"]["targets"] == [f"127.0.0.1:{port}"]
        for name, group in by_node.items():
            (address,) = group["targets"]
            served = sample_labels(address)  # a node serves once its model is loaded: it is
            clash = served & set(group["labels"])  # (the router waits for both nodes)
            assert not clash, (name, clash)
            if name == "router":
                assert {"role", "node"} <= served  # tandem_node_requests_total's, kept
        stop(up)
        assert not targets.exists()
        assert list(targets.parent.iterdir()) == []  # no temporary file left either
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
