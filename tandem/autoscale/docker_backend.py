"""Docker backend: scale the `prefill` / `decode` services of a Compose project via the docker SDK.

Scaling up clones a running replica of the service the way `docker compose up --scale`
does: same image, command, environment, labels (the next container number), networks
with the service's alias, restart policy and healthcheck, named `<project>-<service>-<n>`.
Scaling down stops the chosen containers with a timeout longer than the node's drain
(Docker sends SIGTERM, the node drains and exits; SIGKILL only after the timeout), in a
background thread, then removes them.

Node ids ↔ containers. A clone gets `TANDEM_NODE_ID=<container name>`, so it registers
under its container's name. Replicas that compose started itself have no node id set and
name themselves `<role>-<hostname>-<random>` (shared.runtime.node.make_node_id), where the hostname
is the first 12 characters of the container id: those are found by that prefix.

Compose still owns the project: a later `docker compose up` scales each service back to
its `replicas` (pass `--scale decode=N` or leave it alone while the autoscaler runs), and
`docker compose down` removes the clones along with the rest.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from shared.runtime.node import host_part

log = logging.getLogger("tandem.autoscale.docker")

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"
# Compose marks a container that replaced another with it; a clone replaces nothing.
REPLACE_LABEL = "com.docker.compose.replace"
CLONE_LABEL = "io.tandem.autoscaled"
NODE_ID_ENV = "TANDEM_NODE_ID"


class Container(Protocol):
    """The part of `docker.models.containers.Container` used here."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> dict[str, str]: ...
    @property
    def attrs(self) -> dict[str, Any]: ...
    def start(self) -> None: ...
    def stop(self, *, timeout: int) -> None: ...
    def remove(self, *, force: bool = False) -> None: ...


class Containers(Protocol):
    def list(self, *, all: bool = False, filters: dict[str, Any] | None = None) -> list[Any]: ...
    def create(self, image: str, command: Any = None, **kwargs: Any) -> Any: ...


class Network(Protocol):
    def connect(self, container: Any, *, aliases: list[str] | None = None) -> None: ...


class Networks(Protocol):
    def get(self, network_id: str) -> Network: ...


class DockerClient(Protocol):
    """The part of `docker.DockerClient` used here (the real SDK, or a fake in tests)."""

    @property
    def containers(self) -> Containers: ...
    @property
    def networks(self) -> Networks: ...


class DockerBackendError(RuntimeError):
    pass


class DockerBackend:
    """`Backend` for a Compose project; roles map to services of the same name by default."""

    def __init__(
        self,
        project: str = "tandem",
        *,
        services: Mapping[str, str] | None = None,
        drain_timeout: float = 30.0,
        client: DockerClient | None = None,
    ) -> None:
        if client is None:
            try:  # only this backend needs the SDK (an extra); the rest of tandem runs without
                import docker
            except ImportError as exc:
                raise SystemExit(
                    "error: the Docker backend needs the Docker SDK: pip install 'tandem[docker]'"
                ) from exc
            client = docker.from_env()
        self.client: DockerClient = client
        self.project = project
        self.services = dict(services or {"prefill": "prefill", "decode": "decode"})
        # The node's own drain plus time to flush and exit before Docker kills it.
        self.stop_timeout = math.ceil(drain_timeout) + 10
        self._stopping: set[str] = set()  # container ids asked to stop, not yet removed
        # per service: the last replica cloned from, kept so a service scaled to none (a
        # conditional router's prefill pool) can be scaled up again
        self._templates: dict[str, Container] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # ---- Backend ------------------------------------------------------------------------

    def count(self, role: str) -> int:
        return len(self._serving(role))

    def scale_up(self, role: str, n: int) -> list[str]:
        service = self._service(role)
        existing = self._containers(service, all=True)
        template = self._template(service, existing)
        number = max((_number(c) for c in existing), default=0)
        names = []
        for _ in range(n):
            number += 1
            names.append(self._clone(template, service, number))
        return names  # each clone's node id is its container name

    def scale_down(self, role: str, node_ids: list[str]) -> None:
        for node_id in node_ids:
            container = self.container_for(role, node_id)
            if container is None:
                log.warning("no running container of %s for node %s", role, node_id)
                continue
            self._templates[self._service(role)] = container  # (a service may reach none)
            with self._lock:
                self._stopping.add(container.id)
            thread = threading.Thread(
                target=self._stop, args=(container,), name=f"stop-{container.name}"
            )
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            # Not a daemon: exiting the autoscaler must not abandon a container mid-stop,
            # still running but no longer counted by anyone.
            thread.start()

    # ---- node ids ↔ containers ----------------------------------------------------------

    def container_for(self, role: str, node_id: str) -> Container | None:
        """The running container (not already stopping) that registered as `node_id`."""
        for container in self._serving(role):
            config = container.attrs.get("Config") or {}
            env = config.get("Env") or []
            if f"{NODE_ID_ENV}={node_id}" in env or container.name == node_id:
                return container
            if any(e.startswith(f"{NODE_ID_ENV}=") for e in env):
                continue  # named explicitly, and not this node
            hostname = config.get("Hostname") or container.id[:12]
            if node_id.startswith(f"{role}-{host_part(hostname)}-"):
                return container
        return None

    def wait_stopped(self, timeout: float | None = None) -> None:
        """Wait for the stops in flight (at shutdown, so no container is left half-stopped)."""
        for thread in list(self._threads):
            thread.join(timeout)

    # ---- internals ----------------------------------------------------------------------

    def _service(self, role: str) -> str:
        try:
            return self.services[role]
        except KeyError:
            raise DockerBackendError(f"no compose service for role {role!r}") from None

    def _containers(self, service: str, *, all: bool = False) -> list[Container]:
        labels = [f"{PROJECT_LABEL}={self.project}", f"{SERVICE_LABEL}={service}"]
        filters: dict[str, Any] = {"label": labels}
        if not all:
            filters["status"] = "running"
        found = self.client.containers.list(all=all, filters=filters)
        # `docker compose run` containers carry the service label too; they are not replicas.
        return [c for c in found if c.labels.get(ONEOFF_LABEL, "False") != "True"]

    def _serving(self, role: str) -> list[Container]:
        running = self._containers(self._service(role))
        with self._lock:
            return [c for c in running if c.id not in self._stopping]

    def _template(self, service: str, existing: list[Container]) -> Container:
        # A running replica first: it has the configuration compose last applied.
        running = [c for c in existing if (c.attrs.get("State") or {}).get("Running")]
        candidates = running or existing
        if candidates:
            self._templates[service] = candidates[0]
            return candidates[0]
        if service in self._templates:
            return self._templates[service]
        raise DockerBackendError(
            f"no container of service {service!r} in project {self.project!r} to clone: "
            "start the project with at least one replica (docker compose up)"
        )

    def _clone(self, template: Container, service: str, number: int) -> str:
        attrs = template.attrs
        config, host = attrs.get("Config") or {}, attrs.get("HostConfig") or {}
        name = f"{self.project}-{service}-{number}"
        env = [e for e in config.get("Env") or [] if not e.startswith(f"{NODE_ID_ENV}=")]
        env.append(f"{NODE_ID_ENV}={name}")
        labels = {k: v for k, v in (config.get("Labels") or {}).items() if k != REPLACE_LABEL}
        labels |= {NUMBER_LABEL: str(number), CLONE_LABEL: "true"}
        networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
        # The template's own name, id and hostname are its aliases only; the service's name
        # (and any alias compose.yaml gives) is what the other services resolve.
        own = {template.name, template.id[:12], config.get("Hostname")}
        aliases = {
            net: [a for a in (ep or {}).get("Aliases") or [] if a not in own] + [name]
            for net, ep in networks.items()
        }
        primary = host.get("NetworkMode")
        if primary not in aliases:
            primary = next(iter(aliases), None)
        kwargs: dict[str, Any] = {
            "name": name,
            "environment": env,
            "labels": labels,
            # Hostname is left out on purpose: Docker gives the clone its own (its id).
            "entrypoint": config.get("Entrypoint"),
            "healthcheck": config.get("Healthcheck"),
            "user": config.get("User"),
            "working_dir": config.get("WorkingDir"),
            "stop_signal": config.get("StopSignal"),
            "restart_policy": host.get("RestartPolicy"),
            "init": host.get("Init"),
            "log_config": host.get("LogConfig"),
            "mounts": host.get("Mounts"),
            "volumes": host.get("Binds"),
            "device_requests": host.get("DeviceRequests"),
        }
        if primary is not None:
            kwargs["network"] = primary
            kwargs["networking_config"] = {primary: {"Aliases": aliases[primary]}}
        kwargs = {k: v for k, v in kwargs.items() if v not in (None, "", [], {})}
        # The image id, not the tag: a clone must run the same code as its siblings even if
        # the tag has been rebuilt since (mixed versions would disagree on wire formats).
        image = attrs.get("Image") or config["Image"]
        container = self.client.containers.create(image, config.get("Cmd"), **kwargs)
        try:
            for net in aliases:
                if net != primary:
                    self.client.networks.get(net).connect(container, aliases=aliases[net])
            container.start()
        except Exception:
            # A created but never started clone would hold its name and number forever.
            container.remove(force=True)
            raise
        log.info("started %s (clone of %s)", name, template.name)
        return name

    def _stop(self, container: Container) -> None:
        try:
            container.stop(timeout=self.stop_timeout)
            container.remove()
            log.info("stopped and removed %s", container.name)
        except Exception:
            # A background thread's error would vanish otherwise; the count goes back to
            # what Docker says (the container may still run) so the policy sees the truth.
            log.exception("could not stop %s", container.name)
        finally:
            with self._lock:
                self._stopping.discard(container.id)


def _number(container: Container) -> int:
    try:
        return int(container.labels.get(NUMBER_LABEL, "0"))
    except ValueError:
        return 0
