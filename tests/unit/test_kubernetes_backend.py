"""The autoscaler's Kubernetes backend, with the official client, against a real HTTP server
speaking the part of the Kubernetes API it uses (a Deployment's scale subresource, pods):
the requests the client sends are recorded and checked (bodies, content types, order:
every pod is marked for removal before the replicas go down), an RBAC refusal is a clear
error that scales nothing down, and the calls it makes are exactly what the Role in
deploy/kubernetes/base/autoscaler.yaml allows."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from kubernetes import client

from tandem.autoscale.kubernetes_backend import (
    DELETION_COST,
    KubernetesBackend,
    KubernetesBackendError,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NS = "tandem"
SCALE = re.compile(rf"^/apis/apps/v1/namespaces/{NS}/deployments/([a-z-]+)/scale$")
PODS = re.compile(rf"^/api/v1/namespaces/{NS}/pods$")
POD = re.compile(rf"^/api/v1/namespaces/{NS}/pods/([a-z0-9-]+)$")
VERB = {"GET": "get", "PATCH": "patch"}


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any

    @property
    def rbac(self) -> tuple[str, str, str]:
        """(API group, resource, verb) as RBAC sees this request."""
        if SCALE.match(self.path):
            return ("apps", "deployments/scale", VERB[self.method])
        if PODS.match(self.path):
            return ("", "pods", "list")
        return ("", "pods", VERB[self.method])


@dataclass
class FakeApi:
    """The cluster's state, what was asked of it, and which (method, path regex) it
    refuses as RBAC would (403 with a Status, as the API server answers)."""

    replicas: dict[str, int] = field(default_factory=lambda: {"prefill": 2, "decode": 3})
    pods: dict[str, list[str]] = field(default_factory=dict)
    forbidden: list[tuple[str, re.Pattern[str]]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def answer(self, call: Call) -> tuple[int, dict[str, Any]]:
        self.calls.append(call)
        for method, path in self.forbidden:
            if call.method == method and path.match(call.path):
                return 403, {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                    "reason": "Forbidden",
                    "message": f"{call.path} is forbidden: User cannot {call.method}",
                }  # fmt: skip
        if m := SCALE.match(call.path):
            name = m.group(1)
            if name not in self.replicas:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if call.method == "PATCH":
                self.replicas[name] = int(call.body["spec"]["replicas"])
            return 200, {
                "apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": self.replicas[name]},
                "status": {"replicas": self.replicas[name]},
            }  # fmt: skip
        if PODS.match(call.path):
            role = call.query["labelSelector"][0].split("=")[1]
            items = [
                {
                    "metadata": {
                        "name": n,
                        "namespace": NS,
                        "labels": {"app.kubernetes.io/name": role},
                    }
                }
                for n in self.pods.get(role, [])
            ]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if m := POD.match(call.path):
            meta = {"name": m.group(1), "namespace": NS, **call.body["metadata"]}
            return 200, {"apiVersion": "v1", "kind": "Pod", "metadata": meta}
        return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def handle_one(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            call = Call(
                self.command, url.path, parse_qs(url.query),
                self.headers.get("Content-Type", ""), json.loads(raw) if raw else None,
            )  # fmt: skip
            status, body = state.answer(call)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = handle_one

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def backend_for(url: str) -> KubernetesBackend:
    return KubernetesBackend(NS, client.ApiClient(client.Configuration(host=url)))


def test_scaling_up_and_down_marks_the_chosen_pods_before_the_replicas_drop(
    api: tuple[FakeApi, str],
) -> None:
    state, url = api
    state.pods["decode"] = [
        "decode-7d9f8c6b5-x2x4z",
        "decode-7d9f8c6b5-x2x4",
        "decode-7d9f8c6b5-k8p2q",
    ]
    backend = backend_for(url)
    assert backend.count("decode") == 3 and backend.count("prefill") == 2
    assert len(backend.scale_up("decode", 2)) == 2
    assert state.replicas["decode"] == 5
    up = state.calls[-1]
    assert up.method == "PATCH" and up.body == {"spec": {"replicas": 5}}
    assert "patch" in up.content_type  # a patch, not a replace racing the controller
    state.calls.clear()

    # Node ids as the nodes name themselves (`decode-<pod name>-<6 hex>`); one is no pod's.
    backend.scale_down(
        "decode",
        ["decode-decode-7d9f8c6b5-x2x4z-a1b2c3", "decode-decode-7d9f8c6b5-k8p2q-0f0f0f",
         "decode-decode-gone-123456"],
    )  # fmt: skip
    marked = [c for c in state.calls if c.method == "PATCH" and POD.match(c.path)]
    assert [POD.match(c.path).group(1) for c in marked] == [  # type: ignore[union-attr]
        "decode-7d9f8c6b5-x2x4z",  # exactly that pod, not the one whose name it starts with
        "decode-7d9f8c6b5-k8p2q",
    ]
    for c in marked:
        assert c.body == {"metadata": {"annotations": {DELETION_COST: "-1000000"}}}
        assert "patch" in c.content_type
    scaled = [i for i, c in enumerate(state.calls) if c.method == "PATCH" and SCALE.match(c.path)]
    assert len(scaled) == 1 and state.calls[scaled[0]].body == {"spec": {"replicas": 3}}
    assert scaled[0] > state.calls.index(marked[-1])  # marked, then scaled down
    assert state.replicas["decode"] == 3
    assert state.calls[0].query["labelSelector"] == ["app.kubernetes.io/name=decode"]


def test_an_rbac_refusal_is_a_clear_error_and_scales_nothing_down(
    api: tuple[FakeApi, str],
) -> None:
    state, url = api
    state.pods["decode"] = ["decode-abc-12345"]
    state.forbidden.append(("PATCH", POD))
    backend = backend_for(url)
    with pytest.raises(
        KubernetesBackendError, match=r"may not patch pods in namespace tandem \(RBAC"
    ):
        backend.scale_down("decode", ["decode-decode-abc-12345-abcdef"])
    assert state.replicas["decode"] == 3  # never scaled down without its pod marked
    state.forbidden = [("GET", SCALE)]
    with pytest.raises(KubernetesBackendError, match="may not get deployments/scale"):
        backend.count("prefill")


def test_an_unreachable_api_server_is_an_error_not_a_hang() -> None:
    backend = backend_for("http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(KubernetesBackendError, match=r"unreachable"):
        backend.count("decode")


def test_a_kubeconfig_points_it_at_the_cluster(
    api: tuple[FakeApi, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a pod, `tandem autoscale --backend kubernetes --kubeconfig F` reads F."""
    state, url = api
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }  # fmt: skip
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    backend = KubernetesBackend.from_environment(NS, str(path))
    assert backend.count("decode") == 3
    assert state.calls[-1].path.endswith("/deployments/decode/scale")


def test_the_role_allows_exactly_the_calls_it_makes(api: tuple[FakeApi, str]) -> None:
    state, url = api
    state.pods["prefill"] = ["prefill-abc-12345"]
    backend = backend_for(url)
    backend.scale_up("prefill", 1)
    backend.scale_down("prefill", ["prefill-prefill-abc-12345-abcdef"])
    used = {c.rbac for c in state.calls}
    docs = yaml.safe_load_all((ROOT / "deploy/kubernetes/base/autoscaler.yaml").read_text())
    (role,) = [d for d in docs if d["kind"] == "Role"]
    allowed = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert used == allowed


def test_a_models_pool_scales_its_own_deployments(api: tuple[FakeApi, str]) -> None:
    """`--pool smol-bf16=prefill-second:decode-second`: that model's backend reads and
    patches those Deployments and lists their pods only; the default pool's are untouched."""
    state, url = api
    state.replicas |= {"prefill-second": 1, "decode-second": 2}
    state.pods["decode-second"] = ["decode-second-5c6d7-abcde"]
    state.pods["decode"] = ["decode-7d9f8c6b5-x2x4z"]
    names = {"prefill": "prefill-second", "decode": "decode-second"}
    backend = KubernetesBackend(NS, client.ApiClient(client.Configuration(host=url)), names)
    assert backend.count("decode") == 2 and backend.count("prefill") == 1
    backend.scale_up("prefill", 1)
    assert state.replicas["prefill-second"] == 2 and state.replicas["prefill"] == 2
    backend.scale_down(
        "decode",
        ["decode-decode-second-5c6d7-abcde-a1b2c3", "decode-decode-7d9f8c6b5-x2x4z-a1b2c3"],
    )
    assert state.replicas["decode-second"] == 1 and state.replicas["decode"] == 3
    listed = [c for c in state.calls if PODS.match(c.path)]
    assert [c.query["labelSelector"] for c in listed] == [["app.kubernetes.io/name=decode-second"]]
    marked = [POD.match(c.path).group(1) for c in state.calls if POD.match(c.path)]  # type: ignore[union-attr]
    assert marked == ["decode-second-5c6d7-abcde"]
