"""`tandem up --prometheus-targets FILE`: the Prometheus file_sd file the launcher keeps for
deploy/observability/ — what it lists and how it is labelled, rewritten whole (a rename)
when a node starts or exits, removed when the stack stops — through the Stack's own start,
autoscaler and stop code, with `sleep` processes standing in for the services (no model
node, no NATS: `--nats` names an outside server, never dialled here)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.router.metrics import RouterMetrics
from shared.bus.server import free_port
from shared.telemetry.metrics import NodeMetrics
from tandem.autoscale.local_backend import LocalBackend
from tandem.cli import build_parser
from tandem.launcher import Stack, scrape_address
from tests.unit.test_autoscale_local import stand_ins
from tests.unit.test_dashboards import UP_PROMETHEUS, dashboard_labels, promtool

pytestmark = pytest.mark.unit


def stack_for(targets: Path, *argv: str) -> Stack:
    args = ["up", "--nats", "nats://127.0.0.1:1", "--prometheus-targets", str(targets)]
    return Stack(build_parser().parse_args([*args, "--port", str(free_port()), *argv]))


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Stack]:
    """A stack of 1 kvcache, 1 prefill and 1 decode node and the router, started (as
    stand-ins) with its targets file in a directory that does not exist yet."""
    stack = stack_for(tmp_path / "metrics" / "targets.json", "--prefill", "1", "--decode", "1")
    with stand_ins(stack):
        stack.start()
        try:
            yield stack
        finally:
            stack.stop()


def read(path: Path) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = json.loads(path.read_text())
    return groups


def nodes(path: Path) -> list[str]:
    return [g["labels"].get("node", g["labels"]["job"]) for g in read(path)]


def test_the_file_lists_the_router_and_every_node_with_the_dashboards_labels(
    started: Stack,
) -> None:
    path = started.targets_file
    assert path is not None
    ports = started.metrics_ports
    assert read(path) == [
        {
            "targets": [f"127.0.0.1:{ports['kvcache-1']}"],
            "labels": {"job": "nodes", "role": "kvcache", "node": "kvcache-1"},
        },
        {
            "targets": [f"127.0.0.1:{ports['prefill-1']}"],
            "labels": {"job": "nodes", "role": "prefill", "node": "prefill-1"},
        },
        {
            "targets": [f"127.0.0.1:{ports['decode-1']}"],
            "labels": {"job": "nodes", "role": "decode", "node": "decode-1"},
        },
        # No role/node on the router: its own tandem_node_requests_total{role,node} keeps them.
        {"targets": [f"127.0.0.1:{started.args.port}"], "labels": {"job": "router"}},
    ]
    # Readable by Prometheus' user in its container; no temporary file left beside it.
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(path.parent) == ["targets.json"]


def test_the_file_follows_the_autoscaler_rewritten_whole(started: Stack) -> None:
    path = started.targets_file
    assert path is not None
    before = path.stat().st_ino
    backend = LocalBackend(started)
    assert backend.scale_up("decode", 1) == ["decode-2"]
    assert nodes(path) == ["kvcache-1", "prefill-1", "decode-1", "router", "decode-2"]
    group = read(path)[4]
    assert group["targets"] == [f"127.0.0.1:{started.metrics_ports['decode-2']}"]
    after_add = path.stat().st_ino
    assert after_add != before  # a new file renamed over the old, never rewritten in place

    # Stopped by the autoscaler: listed while it drains, gone once it has exited (what
    # `tandem up`'s loop notices through dead_children, twice a second).
    backend.scale_down("decode", ["decode-2"])
    assert "decode-2" in nodes(path)
    proc = started.child("decode-2").proc
    assert proc is not None
    proc.wait(timeout=10)
    assert started.dead_children() == []  # an exit asked for: not reported as a death
    assert nodes(path) == ["kvcache-1", "prefill-1", "decode-1", "router"]

    # A crash leaves the file too (and is reported); nothing changed: the file is left alone.
    crashed = started.child("prefill-1").proc
    assert crashed is not None
    crashed.kill()
    crashed.wait()
    assert [c.name for c in started.dead_children()] == ["prefill-1"]
    assert nodes(path) == ["kvcache-1", "decode-1", "router"]
    unchanged = path.stat().st_ino
    started.dead_children()
    assert path.stat().st_ino == unchanged
    assert os.listdir(path.parent) == ["targets.json"]


def test_the_file_is_removed_when_the_stack_stops(started: Stack) -> None:
    path = started.targets_file
    assert path is not None and path.exists()
    started.stop()
    assert not path.exists()
    # An autoscaler still finishing its last tick cannot bring it back.
    started.add(LocalBackend(started)._new_child("decode"))
    started.refresh_targets()
    assert not path.exists()


def test_a_file_that_cannot_be_written_stops_the_start_before_anything_runs(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    stack = stack_for(blocker / "targets.json")
    with stand_ins(stack), pytest.raises(RuntimeError, match="cannot write the Prometheus"):
        stack.start()
    assert stack.children == []


def test_scrape_addresses_are_reachable_from_this_machine(tmp_path: Path) -> None:
    assert scrape_address("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert scrape_address("0.0.0.0", 8000) == "127.0.0.1:8000"  # every interface: loopback
    assert scrape_address("::", 8000) == "[::1]:8000"
    assert scrape_address("::1", 9) == "[::1]:9"
    assert scrape_address("localhost", 9) == "localhost:9"
    # A node's /metrics listens where its environment says (the launcher passes no
    # --metrics-host); the router where --host says.
    stack = stack_for(tmp_path / "t.json", "--host", "0.0.0.0", "--kvcache", "0")
    stack.env["TANDEM_METRICS_HOST"] = "::"
    stack.children = stack.plan()
    with stand_ins(stack):
        addresses = {
            g["labels"].get("node", "router"): g["targets"][0] for g in stack.metrics_targets()
        }
    assert addresses["router"] == f"127.0.0.1:{stack.args.port}"
    assert addresses["decode-1"] == f"[::1]:{stack.metrics_ports['decode-1']}"


def test_a_keyed_routers_target_is_its_own_metrics_port(tmp_path: Path) -> None:
    """With API keys the router serves /metrics only on a port of its own (issue 49): the
    launcher gives it one and lists that port, not the API port."""
    keys = tmp_path / "keys.txt"
    keys.write_text("tk-" + "k" * 32 + "\n")
    stack = stack_for(tmp_path / "t.json", "--kvcache", "0", "--api-keys-file", str(keys))
    stack.children = stack.plan()
    router = next(c for c in stack.children if c.name == "router")
    port = stack.metrics_ports["router"]
    assert router.argv[router.argv.index("--metrics-port") + 1] == str(port)
    with stand_ins(stack):
        addresses = {
            g["labels"].get("node", "router"): g["targets"][0] for g in stack.metrics_targets()
        }
    assert addresses["router"] == f"127.0.0.1:{port}" and port != stack.args.port
    open_stack = stack_for(tmp_path / "u.json", "--kvcache", "0")  # no keys: the API port
    open_stack.children = open_stack.plan()
    assert "router" not in open_stack.metrics_ports
    assert all("--metrics-port" not in c.argv for c in open_stack.children if c.name == "router")


def label_names(registry: Any) -> set[str]:
    """Every label name of a registry's metrics, those with no sample yet too (collect()
    shows a labelled metric's names only once it has a child)."""
    return {n for c in registry._collector_to_names for n in getattr(c, "_labelnames", ())}


def test_the_target_labels_take_no_label_of_the_samples_or_the_dashboard(started: Stack) -> None:
    """A target label that a scraped sample also has renames the sample's to exported_*
    (honor_labels is off): the launcher's labels must be none the processes' metrics or
    the dashboard use. The real promtool reads the file as deploy/observability's
    Prometheus would."""
    path = started.targets_file
    assert path is not None
    router = label_names(RouterMetrics().registry)
    assert {"role", "node"} <= router  # what the router's group must not carry
    for group in read(path):
        labels = set(group["labels"])
        role = group["labels"].get("role")
        served = router if role is None else label_names(NodeMetrics(role).registry)
        served |= {"threads", "model"}  # a prefill node's batches; several models' samples
        assert not labels & (served | dashboard_labels()), group

    config = yaml.safe_load(UP_PROMETHEUS.read_text())
    (sd,) = config["scrape_configs"][0]["file_sd_configs"]
    sd["files"] = [str(path.parent / Path(sd["files"][0]).name)]  # the same pattern, here
    local = path.parent.parent / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [promtool(), "check", "config", str(local)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "does not exist" not in out.stdout + out.stderr  # the pattern found the file
