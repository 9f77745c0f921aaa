"""DockerBackend against an in-memory Docker engine, and its create request through the real SDK.

No engine runs here. `FakeClient` has the part of the docker SDK's client surface the
backend uses (`containers.list/create`, `networks.get().connect`, container `attrs`,
`labels`, `start/stop/remove`) over containers shaped like the ones Compose creates. The
last test hands the same create arguments to the real `docker` SDK with only its HTTP call
replaced, to check that they make a valid request body.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from shared.runtime.node import host_part
from tandem.autoscale.docker_backend import (
    CLONE_LABEL,
    NUMBER_LABEL,
    DockerBackend,
    DockerBackendError,
)

pytestmark = pytest.mark.unit

PROJECT = "tandem"
NET = "tandem_default"
IMAGE_ID = "sha256:" + "ab" * 32
HEALTHCHECK = {
    "Test": ["CMD", "python", "-c", "import urllib.request"],
    "Interval": 10_000_000_000,
    "Timeout": 5_000_000_000,
    "Retries": 3,
    "StartPeriod": 120_000_000_000,
}


class FakeContainer:
    def __init__(self, engine: FakeEngine, cid: str, name: str, attrs: dict[str, Any]) -> None:
        self.engine, self.id, self.name, self.attrs = engine, cid, name, attrs
        self.stopped_with: int | None = None
        self.removed = False
        self.release = threading.Event()  # a stop returns once set: a drain in progress
        self.release.set()

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.attrs["Config"]["Labels"])

    @property
    def status(self) -> str:
        return str(self.attrs["State"]["Status"])

    def _set(self, status: str) -> None:
        self.attrs["State"] = {"Status": status, "Running": status == "running"}

    def start(self) -> None:
        self._set("running")

    def stop(self, *, timeout: int) -> None:
        self.stopped_with = timeout
        self.release.wait(5)
        self._set("exited")

    def remove(self, *, force: bool = False) -> None:
        self.removed = True
        del self.engine.by_id[self.id]


class FakeContainers:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.created: list[dict[str, Any]] = []

    def list(self, *, all: bool = False, filters: dict[str, Any] | None = None) -> list[Any]:
        filters = filters or {}
        out = []
        for c in self.engine.by_id.values():
            labels = c.labels
            if not all and c.status != "running":
                continue
            if filters.get("status") and c.status != filters["status"]:
                continue
            wanted = {tuple(label.split("=", 1)) for label in filters.get("label", [])}
            if wanted <= set(labels.items()):
                out.append(c)
        return out

    def create(self, image: str, command: Any = None, **kwargs: Any) -> FakeContainer:
        self.created.append({"image": image, "command": command, **kwargs})
        self.engine.made += 1
        cid = f"{self.engine.made:02d}" + "c" * 62
        net = kwargs.get("network")
        networks = {net: dict(kwargs["networking_config"][net])} if net else {}
        attrs = {
            "Id": cid,
            "Image": image,
            "Config": {
                "Hostname": cid[:12],
                "Cmd": command,
                "Env": kwargs.get("environment", []),
                "Labels": kwargs.get("labels", {}),
            },
            "HostConfig": {"NetworkMode": net},
            "NetworkSettings": {"Networks": networks},
            "State": {"Status": "created", "Running": False},
        }
        c = FakeContainer(self.engine, cid, kwargs["name"], attrs)
        self.engine.by_id[cid] = c
        return c


class FakeNetwork:
    def __init__(self, engine: FakeEngine, name: str) -> None:
        self.engine, self.name = engine, name

    def connect(self, container: Any, *, aliases: list[str] | None = None) -> None:
        container.attrs["NetworkSettings"]["Networks"][self.name] = {"Aliases": aliases}


class FakeNetworks:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def get(self, network_id: str) -> FakeNetwork:
        return FakeNetwork(self.engine, network_id)


class FakeEngine:
    """The fake client: `.containers` and `.networks`, like `docker.DockerClient`."""

    def __init__(self) -> None:
        self.by_id: dict[str, FakeContainer] = {}
        self.made = 0
        self.containers = FakeContainers(self)
        self.networks = FakeNetworks(self)

    def compose_replica(
        self, service: str, number: int, *, status: str = "running", extra_net: bool = False
    ) -> FakeContainer:
        """A container as `docker compose up` makes it (what `docker inspect` shows)."""
        cid = f"{service[0]}{number}" + "f" * 62
        name = f"{PROJECT}-{service}-{number}"
        networks = {NET: {"Aliases": [name, service, cid[:12]]}}
        if extra_net:
            networks["tandem_data"] = {"Aliases": [name, service, "kv-plane"]}
        attrs = {
            "Id": cid,
            "Name": "/" + name,
            "Image": IMAGE_ID,
            "Config": {
                "Hostname": cid[:12],
                "Image": "tandem:local",
                "Cmd": [service],
                "Entrypoint": ["tandem"],
                "Env": ["TANDEM_NATS=nats://nats:4222", "PATH=/usr/bin"],
                "Labels": {
                    "com.docker.compose.project": PROJECT,
                    "com.docker.compose.service": service,
                    "com.docker.compose.container-number": str(number),
                    "com.docker.compose.oneoff": "False",
                    "com.docker.compose.config-hash": "cafe",
                },
                "Healthcheck": HEALTHCHECK,
                "User": "tandem",
                "WorkingDir": "/app",
            },
            "HostConfig": {
                "NetworkMode": NET,
                "RestartPolicy": {"Name": "unless-stopped", "MaximumRetryCount": 0},
                "LogConfig": {"Type": "json-file", "Config": {}},
                "Binds": None,
                "Mounts": None,
            },
            "NetworkSettings": {"Networks": networks},
            "State": {"Status": status, "Running": status == "running"},
        }
        c = FakeContainer(self, cid, name, attrs)
        self.by_id[cid] = c
        return c


@pytest.fixture
def engine() -> FakeEngine:
    e = FakeEngine()
    e.compose_replica("decode", 1)
    e.compose_replica("decode", 2)
    e.compose_replica("decode", 3, status="exited")  # stopped: not counted, number taken
    e.compose_replica("prefill", 1)
    return e


def backend(engine: FakeEngine, **kw: Any) -> DockerBackend:
    return DockerBackend(PROJECT, client=engine, **kw)


def test_count_is_running_containers_of_the_service(engine: FakeEngine) -> None:
    b = backend(engine)
    assert (b.count("decode"), b.count("prefill")) == (2, 1)
    engine.compose_replica("decode", 9).attrs["Config"]["Labels"]["com.docker.compose.oneoff"] = (
        "True"  # a `docker compose run` container is not a replica
    )
    assert b.count("decode") == 2


def test_scale_up_clones_a_replica_with_the_next_number(engine: FakeEngine) -> None:
    b = backend(engine)
    assert b.scale_up("decode", 2) == ["tandem-decode-4", "tandem-decode-5"]
    assert b.count("decode") == 4
    first = engine.containers.created[0]
    assert first["image"] == IMAGE_ID  # the exact image of its siblings, not the tag
    assert first["command"] == ["decode"] and first["entrypoint"] == ["tandem"]
    assert first["environment"] == [
        "TANDEM_NATS=nats://nats:4222",
        "PATH=/usr/bin",
        "TANDEM_NODE_ID=tandem-decode-4",
    ]
    assert first["labels"][NUMBER_LABEL] == "4" and first["labels"][CLONE_LABEL] == "true"
    assert first["labels"]["com.docker.compose.service"] == "decode"
    assert first["labels"]["com.docker.compose.config-hash"] == "cafe"
    assert first["network"] == NET
    # The service alias stays (other services resolve `decode`); the template's own go.
    assert first["networking_config"] == {NET: {"Aliases": ["decode", "tandem-decode-4"]}}
    assert first["restart_policy"] == {"Name": "unless-stopped", "MaximumRetryCount": 0}
    assert first["healthcheck"] == HEALTHCHECK
    assert (first["user"], first["working_dir"]) == ("tandem", "/app")
    assert "hostname" not in first and "volumes" not in first
    assert engine.containers.created[1]["labels"][NUMBER_LABEL] == "5"


def test_scale_up_joins_every_network_of_the_template() -> None:
    engine = FakeEngine()
    engine.compose_replica("prefill", 1, extra_net=True)
    [name] = backend(engine).scale_up("prefill", 1)
    clone = next(c for c in engine.by_id.values() if c.name == name)
    assert clone.attrs["NetworkSettings"]["Networks"] == {
        NET: {"Aliases": ["prefill", name]},
        "tandem_data": {"Aliases": ["prefill", "kv-plane", name]},
    }
    assert clone.status == "running"


def test_scale_up_without_any_replica_says_what_to_do() -> None:
    with pytest.raises(DockerBackendError, match="docker compose up"):
        backend(FakeEngine()).scale_up("decode", 1)


def test_node_ids_map_to_containers(engine: FakeEngine) -> None:
    b = backend(engine)
    [clone_name] = b.scale_up("decode", 1)
    # A clone registers under its container name; compose's own replicas as
    # role-<hostname>-<random> with the hostname their container id's first 12 characters.
    clone = b.container_for("decode", clone_name)
    assert clone is not None and clone.name == "tandem-decode-4"
    replica = b.container_for("decode", "decode-d1ffffffffff-3a9c01")
    assert replica is not None and replica.name == "tandem-decode-1"
    replica = b.container_for("decode", "decode-d2ffffffffff-77aa00")
    assert replica is not None and replica.name == "tandem-decode-2"
    assert b.container_for("decode", "decode-d3ffffffffff-000000") is None  # exited
    assert b.container_for("prefill", "decode-d1ffffffffff-3a9c01") is None  # other service
    # A clone's hostname (its own id) does not make it answer to a self-named id.
    clone_host = clone.attrs["Config"]["Hostname"]
    assert b.container_for("decode", f"decode-{clone_host}-123456") is None


def test_host_part_follows_the_rule_nodes_name_themselves_by(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shared.runtime import node

    for hostname in ("d1ffffffffff", "my.host_name-with-a-long-tail"):
        monkeypatch.setattr(node.socket, "gethostname", lambda h=hostname: h)
        assert node.make_node_id("decode").startswith(f"decode-{host_part(hostname)}-")


def test_scale_down_stops_in_the_background_then_removes(engine: FakeEngine) -> None:
    b = backend(engine, drain_timeout=30)
    victim = b.container_for("decode", "decode-d2ffffffffff-77aa00")
    assert isinstance(victim, FakeContainer)
    victim.release.clear()  # the node is draining: stop() blocks until it exits
    b.scale_down("decode", ["decode-d2ffffffffff-77aa00"])  # returns at once
    assert b.count("decode") == 1  # asked to stop: no longer counted, though still running
    assert victim.status == "running" and not victim.removed
    assert b.container_for("decode", "decode-d2ffffffffff-77aa00") is None  # no double stop
    victim.release.set()
    b.wait_stopped(5)
    assert victim.stopped_with == 40  # the drain timeout plus 10 s to flush and exit
    assert victim.removed and victim.id not in engine.by_id
    assert b.count("decode") == 1
    other = engine.by_id["d1" + "f" * 62]
    assert other.stopped_with is None and not other.removed


def test_a_service_scaled_to_none_scales_up_again(engine: FakeEngine) -> None:
    """A conditional router's prefill pool may go to none (`--prefill-min 0`): its last
    container is removed, and the next scale-up clones what it was."""
    b = backend(engine)
    b.scale_down("prefill", ["prefill-p1ffffffffff-000001"])
    b.wait_stopped(5)
    assert b.count("prefill") == 0 and not b._containers("prefill", all=True)
    [name] = b.scale_up("prefill", 1)
    assert b.count("prefill") == 1
    clone = b.container_for("prefill", name)
    assert clone is not None and clone.attrs["Config"]["Cmd"] == ["prefill"]


def test_scale_down_of_an_unknown_node_is_skipped(engine: FakeEngine) -> None:
    b = backend(engine)
    b.scale_down("decode", ["decode-gone-000000"])
    b.wait_stopped(5)
    assert b.count("decode") == 2


def test_a_failed_stop_counts_the_container_again(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(engine)
    victim = engine.by_id["d1" + "f" * 62]

    def refuse(*, timeout: int) -> None:
        raise RuntimeError("engine unreachable")

    monkeypatch.setattr(victim, "stop", refuse)
    b.scale_down("decode", ["decode-d1ffffffffff-000000"])
    b.wait_stopped(5)
    assert b.count("decode") == 2 and not victim.removed


def test_clone_arguments_make_a_valid_request_for_the_real_sdk(engine: FakeEngine) -> None:
    docker = pytest.importorskip("docker")
    backend(engine).scale_up("decode", 1)
    args = dict(engine.containers.created[0])
    # A client for an engine that is never contacted: the request body is caught before
    # it would be sent (an explicit API version skips the version probe).
    client = docker.DockerClient(base_url="tcp://127.0.0.1:1", version="1.45")
    sent: dict[str, Any] = {}

    def capture(config: dict[str, Any], name: str | None = None, platform: Any = None) -> Any:
        sent.update(config, name=name)
        raise RuntimeError("captured")

    client.api.create_container_from_config = capture
    with pytest.raises(RuntimeError, match="captured"):
        client.containers.create(args.pop("image"), args.pop("command"), **args)
    assert sent["name"] == "tandem-decode-4"
    assert sent["Image"] == IMAGE_ID and sent["Cmd"] == ["decode"]
    assert "TANDEM_NODE_ID=tandem-decode-4" in sent["Env"]
    assert sent["Labels"][NUMBER_LABEL] == "4"
    assert sent["Healthcheck"]["Test"] == HEALTHCHECK["Test"]
    assert sent["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert sent["HostConfig"]["NetworkMode"] == NET
    aliases = sent["NetworkingConfig"]["EndpointsConfig"][NET]["Aliases"]
    assert aliases == ["decode", "tandem-decode-4"]
    client.close()


def test_listing_filters_make_a_valid_request_for_the_real_sdk() -> None:
    docker = pytest.importorskip("docker")
    client = docker.DockerClient(base_url="tcp://127.0.0.1:1", version="1.45")
    sent: dict[str, Any] = {}

    def capture(url: str, **kwargs: Any) -> Any:
        sent.update(kwargs["params"])
        raise RuntimeError("captured")

    client.api._get = capture
    with pytest.raises(RuntimeError, match="captured"):
        DockerBackend(PROJECT, client=client).count("decode")
    assert sent["all"] == 0  # the SDK sends the flag as an integer
    assert json.loads(sent["filters"]) == {
        "label": ["com.docker.compose.project=tandem", "com.docker.compose.service=decode"],
        "status": ["running"],
    }
    client.close()


def test_a_models_pool_scales_its_own_services_only(engine: FakeEngine) -> None:
    """`tandem autoscale --pool smol-bf16=prefill-second:decode-second`: that model's
    backend counts, clones and stops the containers of its services, never the others'."""
    engine.compose_replica("decode-second", 7)
    b = backend(engine, services={"prefill": "prefill-second", "decode": "decode-second"})
    assert b.count("decode") == 1 and b.count("prefill") == 0
    assert b.scale_up("decode", 1) == ["tandem-decode-second-8"]
    created = engine.containers.created[0]
    assert created["labels"]["com.docker.compose.service"] == "decode-second"
    assert b.count("decode") == 2
    # a node of the default model's pool (tandem-decode-1) is not this backend's to stop
    assert b.container_for("decode", "decode-d1ffffffffff-3a9c01") is None
    b.scale_down("decode", ["decode-d1ffffffffff-3a9c01", "decode-d7ffffffffff-0a0b0c"])
    b.wait_stopped(5)
    assert engine.by_id["d1" + "f" * 62].stopped_with is None
    assert "d7" + "f" * 62 not in engine.by_id  # its own: stopped and removed
    assert b.count("decode") == 1 and backend(engine).count("decode") == 2
