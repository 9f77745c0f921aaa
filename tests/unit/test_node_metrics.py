"""A node's metrics port: its own metrics, or (a decode process hosting several models)
every model's, each sample labelled with its model."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.telemetry.metrics import NodeMetrics

pytestmark = pytest.mark.unit


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):  # the parser refuses a family twice
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_one_port_serves_every_hosted_models_metrics_labelled_by_model() -> None:
    first, second = NodeMetrics("decode"), NodeMetrics("decode")
    first.gauge("tandem_decode_running_sequences", "Sequences running", lambda: 3)
    second.gauge("tandem_decode_running_sequences", "Sequences running", lambda: 5)
    first.tokens.inc(7)
    second.tokens.inc(11)
    second.transfer_bytes.labels(direction="receive").inc(100)
    port = first.serve(0)
    assert port is not None
    alone = scrape(port)
    assert alone["tandem_decode_tokens_total"] == [({}, 7.0)]  # unlabelled, as ever
    first.serve_models({"a": first, "b": second})
    both = scrape(port)
    assert sorted(both["tandem_decode_tokens_total"], key=str) == [
        ({"model": "a"}, 7.0),
        ({"model": "b"}, 11.0),
    ]
    assert sorted(both["tandem_decode_running_sequences"], key=str) == [
        ({"model": "a"}, 3.0),
        ({"model": "b"}, 5.0),
    ]
    got = both["tandem_kv_transfer_bytes_total"]
    assert ({"direction": "receive", "model": "b"}, 100.0) in got
    assert all(
        labels.get("model") in ("a", "b") for series in both.values() for labels, _ in series
    )
