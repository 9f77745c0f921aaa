"""Kubernetes backend: scale the `prefill` and `decode` Deployments through the Kubernetes
API, with the official client (`kubernetes`), as deploy/kubernetes deploys them.

Node ids ↔ pods. A pod's hostname is its name, and a node names itself
`<role>-<hostname>-<6 hex>` (shared.runtime.node.make_node_id), so node
`decode-decode-7d9f8c6b5-x2x4z-a1b2c3` runs in pod `decode-7d9f8c6b5-x2x4z`.

Scaling up raises the Deployment's replicas (its `scale` subresource). Scaling down keeps
the other backends' drain-before-removal: the chosen pods are first marked with the
lowest `controller.kubernetes.io/pod-deletion-cost`, so that the ReplicaSet removes
exactly those when the replicas then go down; each gets SIGTERM, drains (a decode node
finishes or hands off its streams within --drain-timeout) and exits within its
terminationGracePeriodSeconds.

Every call is in one namespace and is one deploy/kubernetes/base/autoscaler.yaml's Role
allows: deployments/scale get and patch, pods list and patch. A refused call (RBAC, or
anything else the API answers with an error) raises KubernetesBackendError saying which
call and why; every call has a timeout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from shared.runtime.node import host_part

log = logging.getLogger("tandem.autoscale.kubernetes")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REMOVE_FIRST = "-1000000"  # below any cost an operator sets: these pods go first
NAME_LABEL = "app.kubernetes.io/name"  # the pods of Deployment X carry X here
TIMEOUT = 10.0  # seconds, every API call
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
T = TypeVar("T")


class KubernetesBackendError(RuntimeError):
    pass


class KubernetesBackend:
    """Scales Deployments in `namespace`: named after the roles (`prefill`, `decode`) by
    default, or as `deployments` maps the roles (one model's pool: `prefill-second`, ...).
    A Deployment's pods carry its name in `app.kubernetes.io/name`, as deploy/kubernetes
    labels them."""

    def __init__(
        self, namespace: str, api_client: Any, deployments: Mapping[str, str] | None = None
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.deployments = dict(deployments or {"prefill": "prefill", "decode": "decode"})
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    @classmethod
    def from_environment(
        cls,
        namespace: str | None,
        kubeconfig: str | None,
        deployments: Mapping[str, str] | None = None,
    ) -> KubernetesBackend:
        """In a pod: its service account (and its namespace unless given); elsewhere the
        kubeconfig (`--kubeconfig`, else KUBECONFIG or ~/.kube/config)."""
        try:  # an extra: only this backend needs the client
            from kubernetes import client, config
        except ImportError as exc:
            raise SystemExit(
                "error: the Kubernetes backend needs its client: pip install 'tandem[kubernetes]'"
            ) from exc
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not kubeconfig:
            config.load_incluster_config()
            if namespace is None and SA_NAMESPACE.exists():
                namespace = SA_NAMESPACE.read_text().strip()
        else:
            config.load_kube_config(config_file=kubeconfig)
        return cls(namespace or "default", client.ApiClient(), deployments)

    # ---- Backend -----------------------------------------------------------------------------

    def count(self, role: str) -> int:
        """The Deployment's replicas (pods being removed are no longer counted)."""
        return self._replicas(role)

    def scale_up(self, role: str, n: int) -> list[str]:
        before = self._replicas(role)
        self._set_replicas(role, before + n)
        # The new pods' names (and node ids) exist only once the ReplicaSet makes them.
        return [f"{role} replica {before + i + 1} of {before + n}" for i in range(n)]

    def scale_down(self, role: str, node_ids: list[str]) -> None:
        pods = self._pods_of(role, node_ids)
        if not pods:
            return
        for pod in pods:  # marked first: the ReplicaSet then removes exactly these
            self._mark_for_removal(pod)
        before = self._replicas(role)
        after = max(0, before - len(pods))
        self._set_replicas(role, after)
        log.info("draining %s (%s: %d -> %d replicas)", ", ".join(pods), role, before, after)

    # ---- the API calls ---------------------------------------------------------------------

    def _deployment(self, role: str) -> str:
        try:
            return self.deployments[role]
        except KeyError:
            raise KubernetesBackendError(f"no Deployment for role {role!r}") from None

    def _replicas(self, role: str) -> int:
        name = self._deployment(role)
        scale = self._call(
            "get deployments/scale",
            lambda: self.apps.read_namespaced_deployment_scale(
                name, self.namespace, _request_timeout=TIMEOUT
            ),
        )
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def _set_replicas(self, role: str, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        name = self._deployment(role)
        self._call(
            "patch deployments/scale",
            lambda: self.apps.patch_namespaced_deployment_scale(
                name, self.namespace, body, _request_timeout=TIMEOUT
            ),
        )

    def _mark_for_removal(self, pod: str) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: REMOVE_FIRST}}}
        self._call(
            "patch pods",
            lambda: self.core.patch_namespaced_pod(
                pod, self.namespace, body, _request_timeout=TIMEOUT
            ),
        )

    def _pods_of(self, role: str, node_ids: list[str]) -> list[str]:
        """The pods running these nodes (a node id with no pod is logged and left out)."""
        selector = f"{NAME_LABEL}={self._deployment(role)}"
        listed = self._call(
            "list pods",
            lambda: self.core.list_namespaced_pod(
                self.namespace, label_selector=selector, _request_timeout=TIMEOUT
            ),
        )
        names = [
            str(p.metadata.name)
            for p in listed.items
            if p.metadata is not None and p.metadata.deletion_timestamp is None
        ]
        found = []
        for node_id in node_ids:
            pod = next((n for n in names if _runs(node_id, role, n)), None)
            if pod is None:
                log.warning("no %s pod runs node %s: not removed", role, node_id)
            else:
                found.append(pod)
        return found

    def _call(self, what: str, call: Callable[[], T]) -> T:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return call()
        except ApiException as exc:
            if exc.status == 403:
                raise KubernetesBackendError(
                    f"the autoscaler may not {what} in namespace {self.namespace} (RBAC: "
                    f"give its service account that verb; deploy/kubernetes/base/autoscaler.yaml)"
                ) from exc
            raise KubernetesBackendError(
                f"{what} in namespace {self.namespace} failed: HTTP {exc.status} {exc.reason}"
            ) from exc
        except (OSError, HTTPError) as exc:  # refused, timed out: the API server is away
            raise KubernetesBackendError(f"{what}: the API server is unreachable ({exc})") from exc


def _runs(node_id: str, role: str, pod: str) -> bool:
    """Whether self-named node `node_id` runs in pod `pod` (exactly: the 6 hex follow)."""
    prefix = f"{role}-{host_part(pod)}-"
    rest = node_id[len(prefix) :]
    return (
        node_id.startswith(prefix) and len(rest) == 6 and all(c in "0123456789abcdef" for c in rest)
    )
