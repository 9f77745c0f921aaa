"""deploy/observability/compose.yaml (Jaeger, Prometheus and Grafana for `tandem up`), checked
offline by the real Compose binary (as tests/unit/test_compose.py checks compose.yaml): the
same images and dashboards as compose.yaml, every service on the host's network but
listening on the loopback alone, Prometheus reading the directory `tandem up
--prometheus-targets` writes to, and the commands docs/observability.md gives agreeing with
both."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.cli import build_parser
from tests.unit.test_compose import compose_binary
from tests.unit.test_dashboards import UP_PROMETHEUS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "deploy" / "observability" / "compose.yaml"
MAIN = ROOT / "compose.yaml"
DOCS = ROOT / "docs" / "observability.md"
SERVICES = {"jaeger", "prometheus", "grafana"}
DEFAULT_TARGETS_DIR = "/tmp/tandem-metrics"  # the compose file's default


def resolve(tmp_path: Path, **env: str) -> dict[str, Any]:
    """`docker compose -f deploy/observability/compose.yaml config` in a minimal environment
    (plus `env`): a developer's exported variables or a stray .env change nothing."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    command = ["-f", str(FILE), "--env-file", str(empty), "config", "--format", "json"]
    done = subprocess.run(
        [str(compose_binary()), *command],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **env},
        timeout=60,
    )
    assert done.returncode == 0, f"docker compose config failed:\n{done.stderr}"
    model: dict[str, Any] = json.loads(done.stdout)
    return model


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts: container path → host path."""
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "bind"}


def option(command: list[str], name: str) -> str:
    """The value of `name=VALUE` in a command (`name` may hold a `=`: --set=KEY)."""
    (value,) = [arg[len(name) + 1 :] for arg in command if arg.startswith(name + "=")]
    return value


def test_same_images_and_dashboards_as_compose_yaml(tmp_path: Path) -> None:
    services = resolve(tmp_path)["services"]
    main = yaml.safe_load(MAIN.read_text())["services"]
    assert set(services) == SERVICES
    for name in SERVICES:
        assert services[name]["image"] == main[name]["image"], name
    grafana, main_grafana = services["grafana"], main["grafana"]
    # The dashboards and their provisioning are deploy/grafana's own files.
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounts(grafana) == {
        "/etc/grafana/provisioning/dashboards": str(provisioning / "dashboards"),
        "/etc/grafana/provisioning/datasources": str(FILE.parent / "grafana" / "datasources"),
        "/var/lib/grafana/dashboards": str(ROOT / "deploy" / "grafana" / "dashboards"),
    }
    assert all(Path(source).is_dir() for source in mounts(grafana).values())
    # compose.yaml's anonymous, read-only Grafana, opening on the Tandem dashboard.
    for key, value in main_grafana["environment"].items():
        assert grafana["environment"][key] == value, key


def test_every_service_shares_the_hosts_network_on_the_loopback_alone(tmp_path: Path) -> None:
    """`tandem up`'s ports are on this machine's loopback: only the host's network reaches
    them. None of the three has authentication: each listens on 127.0.0.1, at the ports
    compose.yaml publishes its UIs on."""
    services = resolve(tmp_path)["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service, name  # meaningless on the host's network
    jaeger = services["jaeger"]
    assert jaeger["environment"]["JAEGER_LISTEN_HOST"] == "127.0.0.1"
    query = "--set=extensions.jaeger_query"
    assert option(jaeger["command"], query + ".http.endpoint") == "127.0.0.1:16686"
    assert option(jaeger["command"], query + ".grpc.endpoint") == "127.0.0.1:16685"
    prometheus = services["prometheus"]
    assert option(prometheus["command"], "--web.listen-address") == "127.0.0.1:9090"
    grafana = services["grafana"]["environment"]
    assert (grafana["GF_SERVER_HTTP_ADDR"], grafana["GF_SERVER_HTTP_PORT"]) == ("127.0.0.1", "3000")
    # Its data source follows Prometheus' port (grafana/datasources/prometheus.yml reads it).
    moved = resolve(tmp_path, PROMETHEUS_PORT="9191", GRAFANA_PORT="3131", JAEGER_UI_PORT="17000")
    moved_services = moved["services"]
    listen = option(moved_services["prometheus"]["command"], "--web.listen-address")
    assert listen == "127.0.0.1:9191"
    assert moved_services["grafana"]["environment"]["PROMETHEUS_PORT"] == "9191"
    assert moved_services["grafana"]["environment"]["GF_SERVER_HTTP_PORT"] == "3131"
    ui = option(moved_services["jaeger"]["command"], query + ".http.endpoint")
    assert ui == "127.0.0.1:17000"


def test_prometheus_reads_the_directory_tandem_up_writes_its_targets_in(tmp_path: Path) -> None:
    """The targets file's directory is mounted whole (the launcher renames a new file over
    the old one: a mount of the file alone would keep showing the old one), where the
    file_sd pattern of deploy/observability/prometheus.yml looks."""
    prometheus = resolve(tmp_path)["services"]["prometheus"]
    config = option(prometheus["command"], "--config.file")
    (sd,) = yaml.safe_load(UP_PROMETHEUS.read_text())["scrape_configs"][0]["file_sd_configs"]
    (pattern,) = sd["files"]
    targets = str(Path(pattern).parent)
    assert mounts(prometheus) == {config: str(UP_PROMETHEUS), targets: DEFAULT_TARGETS_DIR}
    assert all(v["read_only"] for v in prometheus["volumes"] if v["type"] == "bind")
    assert Path(pattern).suffix == ".json"  # never the launcher's .tmp files
    elsewhere = tmp_path / "my-targets"
    moved = resolve(tmp_path, PROMETHEUS_TARGETS_DIR=str(elsewhere))["services"]["prometheus"]
    assert mounts(moved)[targets] == str(elsewhere)


def test_the_documented_commands_agree_with_the_files() -> None:
    """docs/observability.md's `tandem up` command parses, sends traces to this Jaeger's
    OTLP/HTTP port and writes its targets in the directory Prometheus reads by default."""
    text = DOCS.read_text()
    assert "docker compose -f deploy/observability/compose.yaml up -d" in text
    lines = [line for line in text.splitlines() if "--prometheus-targets" in line]
    command = next(line for line in lines if line.lstrip().startswith("tandem up"))
    command = re.sub(r"\s+#.*$", "", command).strip()
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.otlp_endpoint == "http://127.0.0.1:4318"
    assert str(Path(args.prometheus_targets).parent) == DEFAULT_TARGETS_DIR
