"""Secrets go where they are needed and known ones are refused: `tandem up` hands API keys to
the router alone (whatever the caller's environment holds) and each service its own role's
NATS identity, and no service connects to NATS with the password .env.example ships with."""

from __future__ import annotations

import pytest

from shared.bus.auth import EXAMPLE_PASSWORD, BusAuth, ClusterAuth
from shared.errors import TandemError
from tandem.cli import build_parser
from tandem.launcher import Stack

KEY = "tk-0123456789abcdef0123"


def test_up_gives_api_keys_to_the_router_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEYS", KEY)  # exported by the caller: read by `up`
    stack = Stack(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1"]))
    envs = {child.name: stack.child_env(child) for child in stack.plan()}
    assert envs["router"]["TANDEM_API_KEYS"] == KEY
    others = [name for name in envs if name != "router"]
    assert others and all("TANDEM_API_KEYS" not in envs[n] for n in others), others


def test_up_gives_each_service_its_roles_nats_identity() -> None:
    stack = Stack(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1"]))
    cluster = ClusterAuth.generate()
    stack.auth, stack.role_auth = cluster.admin, cluster.roles  # what start() does
    envs = {child.name: stack.child_env(child) for child in stack.plan()}
    assert {n: e["TANDEM_NATS_USER"] for n, e in envs.items()} == {
        "kvcache-1": "kvcache", "prefill-1": "prefill", "decode-1": "decode", "router": "router"
    }  # fmt: skip
    for name, env in envs.items():
        role = env["TANDEM_NATS_USER"]
        assert env["TANDEM_NATS_PASSWORD"] == cluster.roles[role].password, name
    assert stack.auth_for("autoscaler") is cluster.roles["autoscaler"]
    assert cluster.admin.password not in {e["TANDEM_NATS_PASSWORD"] for e in envs.values()}


def test_the_example_nats_password_is_refused() -> None:
    with pytest.raises(TandemError, match="NATS_PASSWORD"):
        BusAuth(user="tandem", password=EXAMPLE_PASSWORD).connect_kwargs()
    assert BusAuth(user="tandem", password="p-own-secret-123").connect_kwargs()["user"] == "tandem"


def test_env_example_ships_the_refused_password() -> None:
    from tests.unit.test_compose import ENV_EXAMPLE

    assert f"NATS_PASSWORD={EXAMPLE_PASSWORD}\n" in ENV_EXAMPLE.read_text()
