"""deploy/kubernetes rendered by the real kustomize (`kubectl kustomize`) for the base and
each overlay, every object validated against the Kubernetes OpenAPI schema of a current
release (kubernetes-validate, strict: unknown fields fail too), a broken copy refused, and
the production details the deployment promises checked on what renders: the variables each
command reads, probes, drains, disruption budgets, locked-down containers, NATS replicas
and the NATS identities shared/bus/permissions.py defines."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from shared.bus.permissions import compose_authorization
from shared.bus.server import nats_server_binary
from tandem.cli import build_parser
from tests.tools import missing_tool
from tests.unit.test_compose import (
    DIRECT_TANDEM_VARS,
    TANDEM_COMMANDS,
    clear_tandem_env,
    env_read_by,
    otel_vars_read,
    subcommands,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VARIANTS = ["base", "overlays/cpu", "overlays/gpu", "overlays/rdma"]
# Keys of the Secrets the operator creates (docs/kubernetes.md shows the commands).
SECRET_KEYS = {
    "tandem-nats": {
        "admin-user", "admin-password", "router-password", "prefill-password",
        "decode-password", "kvcache-password", "autoscaler-password",
    },
    "tandem-api": {"keys"},
}  # fmt: skip
WORKLOADS = {"Deployment", "StatefulSet"}
COMMANDS = TANDEM_COMMANDS | {"autoscale"}


def kubectl() -> str:
    """`make` fetches kubectl into .tools/ (from npm); else one on PATH."""
    fetched = ROOT / ".tools" / "kubectl"
    if fetched.is_file():
        return str(fetched)
    found = shutil.which("kubectl")
    if found is None:
        missing_tool("kubectl not found (in .tools/, which `make` fills from npm, or on PATH)")
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=VARIANTS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(KUBE / request.param)


def validation_errors(objects: list[dict[str, Any]]) -> list[str]:
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, latest_version(), strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} {where}: {exc.message}")
    return errors


def of_kind(objects: list[dict[str, Any]], *kinds: str) -> Iterator[dict[str, Any]]:
    return (o for o in objects if o["kind"] in kinds)


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in of_kind(objects, kind) if o["metadata"]["name"] == name)


def tandem_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, container) of every container running the Tandem image."""
    for w in of_kind(objects, *WORKLOADS):
        for c in w["spec"]["template"]["spec"]["containers"]:
            if "tandem" in c["image"] and c["args"][0] in COMMANDS:
                yield w["metadata"]["name"], c


def environment(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's variables: its ConfigMaps' (as rendered) and its own; a Secret's
    value stands in as a placeholder."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "from-a-secret-or-field")
    return env


def test_every_variant_renders_and_validates(rendered: list[dict[str, Any]]) -> None:
    assert validation_errors(rendered) == []
    kinds = {o["kind"] for o in rendered}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget"} <= kinds
    assert {"NetworkPolicy", "ConfigMap", "Namespace"} <= kinds
    assert all(
        o["metadata"].get("namespace") == "tandem" for o in rendered if o["kind"] != "Namespace"
    )


def test_a_broken_copy_is_refused(tmp_path: Path) -> None:
    """The validator reads what renders: a wrong type, an unknown field and a missing
    required field each fail; a kustomization naming a missing file does not render."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    router = copy / "base" / "router.yaml"
    text = router.read_text()
    for broken, why in [
        (text.replace("  replicas: 2\n", "  replicas: two\n", 1), "replicas"),
        (text.replace("readinessProbe:", "readinesProbe:", 1), "readinesProbe"),
        (text.replace("{name: http, containerPort: 8000}", "{name: http}", 1), "containerPort"),
    ]:
        assert broken != text
        router.write_text(broken)
        errors = validation_errors(render(copy / "overlays" / "cpu"))
        assert any(why in e for e in errors), (why, errors)
    router.unlink()
    out = subprocess.run([kubectl(), "kustomize", str(copy / "base")], capture_output=True)
    assert out.returncode != 0


def test_every_variable_is_one_the_command_reads(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every TANDEM_* variable of a container is an option of its command (a renamed
    option fails here, not in a cluster), and the command parses with them."""
    otel = otel_vars_read()
    commands = set()
    for name, container in tandem_containers(rendered):
        command = container["args"][0]
        commands.add(command)
        env = environment(rendered, container)
        with monkeypatch.context() as m:
            clear_tandem_env(m)
            for key, value in env.items():
                m.setenv(key, value)
            parsers = subcommands()
            build_parser().parse_args(container["args"])
        readable = env_read_by(parsers[command]) | set(DIRECT_TANDEM_VARS)
        for var in env:
            if var.startswith("TANDEM_"):
                assert var in readable, f"{name}: `tandem {command}` ignores {var}"
            elif var.startswith("OTEL_"):
                assert var in otel, f"{name}: {var} is not an OTEL_* variable Tandem honours"
            else:  # the RDMA overlay's transport settings, read by UCX itself
                assert var.startswith("UCX_"), f"{name}: unexpected variable {var}"
        if command in TANDEM_COMMANDS:  # the services that create the streams
            assert env["TANDEM_NATS_REPLICAS"] == "3"
    assert commands == COMMANDS


def test_containers_are_locked_down_and_probed(rendered: list[dict[str, Any]]) -> None:
    for w in of_kind(rendered, *WORKLOADS):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert "ALL" in sc["capabilities"]["drop"]
            if c.get("ports"):  # what serves is probed
                assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:  # only keys of the Secrets the docs tell operators to create
                    assert ref["key"] in SECRET_KEYS[ref["name"]], ref
    for name in ("router", "prefill", "decode", "nats"):
        assert any(p["metadata"]["name"] == name for p in of_kind(rendered, "PodDisruptionBudget"))


def test_routers_nats_and_decode_drain_as_promised(rendered: list[dict[str, Any]]) -> None:
    router = named(rendered, "Deployment", "router")
    assert router["spec"]["replicas"] >= 2  # a client resumes a stream on the other
    nats = named(rendered, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    decode = named(rendered, "Deployment", "decode")
    pod = decode["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = float(environment(rendered, container)["TANDEM_DRAIN_TIMEOUT"])
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # SIGTERM comes after the preStop pause; the drain and a hand-off must fit before SIGKILL
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 15


def test_nats_gets_every_roles_identity_from_permissions() -> None:
    conf = (KUBE / "base" / "nats.conf").read_text()
    assert compose_authorization() in conf, "run: python -m shared.bus.permissions"
    assert "cluster {" in conf and "jetstream {" in conf


def test_nats_config_passes_nats_server_with_the_statefulsets_environment() -> None:
    """The real nats-server checks the file (`-t`) with the variables the StatefulSet sets,
    and refuses it when one of them is missing."""
    nats = named(render(KUBE / "base"), "StatefulSet", "nats")
    (container,) = nats["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: "x" for v in container["env"]}
    conf = str(KUBE / "base" / "nats.conf")
    ok = subprocess.run([nats_server_binary(), "-t", "-c", conf], env=env, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    env.pop("NATS_DECODE_PASSWORD")
    bad = subprocess.run([nats_server_binary(), "-t", "-c", conf], env=env, capture_output=True)
    assert bad.returncode != 0 and b"NATS_DECODE_PASSWORD" in bad.stderr + bad.stdout


COST = "controller.kubernetes.io/pod-deletion-cost"


def admits(policy: dict[str, Any], old: dict[str, Any], new: dict[str, Any], user: str) -> bool:
    """What the API server decides for an UPDATE of pod `old` to `new` by `user`, from the
    policy's own CEL expressions (evaluated by cel-python: the same language)."""
    import celpy

    env = celpy.Environment()
    request = {"namespace": "tandem", "userInfo": {"username": user}}
    activation = {
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(request),
    }

    def holds(expression: str) -> bool:
        return bool(env.program(env.compile(expression)).evaluate(activation))

    if not all(holds(c["expression"]) for c in policy["spec"]["matchConditions"]):
        return True  # not the autoscaler's request: the policy does not apply
    return all(holds(v["expression"]) for v in policy["spec"]["validations"])


def test_the_autoscaler_may_patch_only_the_deletion_cost_of_the_pods_it_scales() -> None:
    """issue 49: its Role may patch every pod of the namespace (RBAC cannot name an
    annotation or a label); the admission policy beside it narrows that to what
    tandem/autoscale/kubernetes_backend.py does."""
    objects = render(KUBE / "base")
    policy = named(objects, "ValidatingAdmissionPolicy", "tandem-autoscaler-pod-patches")
    binding = named(objects, "ValidatingAdmissionPolicyBinding", "tandem-autoscaler-pod-patches")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert policy["spec"]["failurePolicy"] == "Fail"
    me = "system:serviceaccount:tandem:tandem-autoscaler"

    def pod(workload: str) -> dict[str, Any]:
        template = named(objects, "Deployment", workload)["spec"]["template"]
        return {"metadata": dict(template["metadata"]), "spec": template["spec"]}

    def changed(old: dict[str, Any], **metadata: Any) -> dict[str, Any]:
        return {"metadata": {**old["metadata"], **metadata}, "spec": old["spec"]}

    for role in ("prefill", "decode"):
        old = pod(role)
        marked = changed(old, annotations={**old["metadata"].get("annotations", {}), COST: "-1000"})
        assert admits(policy, old, marked, me), role  # what the backend sends
        assert admits(policy, marked, old, me), role  # and taking it back
        relabelled = changed(
            marked, labels={**old["metadata"]["labels"], "app.kubernetes.io/name": "x"}
        )
        assert not admits(policy, old, relabelled, me)
        extra = changed(old, annotations={**old["metadata"].get("annotations", {}), "x": "y"})
        assert not admits(policy, old, extra, me)
        if old["metadata"].get("annotations"):  # dropping another annotation changes it too
            assert not admits(policy, old, changed(old, annotations={COST: "1"}), me)
        respecced = {"metadata": old["metadata"], "spec": {**old["spec"], "hostNetwork": True}}
        assert not admits(policy, old, respecced, me)
    router = pod("router")
    marked = changed(router, annotations={COST: "-1000"})
    assert not admits(policy, router, marked, me)  # not a pod it scales
    assert admits(policy, router, marked, "system:serviceaccount:tandem:someone-else")


def test_kvcache_pods_send_only_to_the_data_plane_nats_traces_and_dns() -> None:
    """issue 49: a get names where a kvcache pod sends; its pods' egress is closed but for
    the data-plane port of the pods that move KV, NATS, the traces collector and DNS."""
    objects = render(KUBE / "base")
    policy = named(objects, "NetworkPolicy", "kvcache-egress")
    kvcache = named(objects, "StatefulSet", "kvcache")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= kvcache.items()
    data_port = int(named(objects, "ConfigMap", "tandem-data-plane")["data"]["TANDEM_DATA_PORT"])
    allowed: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["egress"]:
        assert rule["to"], rule  # never "anywhere"
        for port in rule["ports"]:
            allowed.setdefault(port["port"], []).extend(rule["to"])
    assert set(allowed) == {data_port, 4222, 4317, 4318, 53}
    for role in ("prefill", "decode"):  # the data-plane rule reaches the pods that move KV
        labels = named(objects, "Deployment", role)["spec"]["template"]["metadata"]["labels"]
        assert any(
            t["podSelector"]["matchLabels"].items() <= labels.items() for t in allowed[data_port]
        ), role
