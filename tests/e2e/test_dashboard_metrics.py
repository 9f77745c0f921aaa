"""Every metric the Grafana dashboard reads (deploy/grafana/dashboards/tandem.json) is one
the running stack's processes serve, under that exact name: a renamed metric would leave a
panel empty without any other test noticing."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.launcher import Stack
from tests.e2e.test_api import MODEL, client
from tests.unit.test_dashboards import metric_names

pytestmark = pytest.mark.e2e


SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}


def served(url: str) -> set[str]:
    """Every series name a process serves, or declares (a labelled counter with nothing
    counted yet, e.g. errors, has its HELP and TYPE but no sample)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    names = {s.name for f in families for s in f.samples}
    names |= {f.name + suffix for f in families for suffix in SUFFIXES.get(f.type, [""])}
    return names


def test_every_metric_the_dashboard_reads_is_served(stack: Stack) -> None:
    with client(stack) as c:  # labelled counters appear once they counted something
        c.completions.create(model=MODEL, prompt="Dashboards", max_tokens=4, temperature=0)
    names = served(stack.url + "/metrics")
    for port in stack.metrics_ports.values():
        names |= served(f"http://127.0.0.1:{port}/metrics")
    missing = metric_names() - names
    assert not missing, f"the dashboard reads metrics no process serves: {sorted(missing)}"
