"""An open API (no keys) is refused beyond loopback unless `--allow-open` says so (issue
49): the router's own check, and `tandem up`'s before anything starts."""

from __future__ import annotations

import pytest

from services.router.main import api_keys, metrics_refusal
from shared.runtime.options import is_loopback, open_api_problem
from tandem.cli import build_parser
from tandem.up import run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("router.example", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert (open_api_problem(host, keys_given=False, allow_open=False) is None) is loopback
    assert open_api_problem(host, keys_given=True, allow_open=False) is None
    assert open_api_problem(host, keys_given=False, allow_open=True) is None


def test_the_router_refuses_an_open_api_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    monkeypatch.delenv("TANDEM_ALLOW_OPEN", raising=False)
    args = build_parser().parse_args(["router", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="--allow-open"):
        api_keys(args)
    assert not api_keys(build_parser().parse_args(["router"])).enabled  # loopback: open
    args = build_parser().parse_args(["router", "--host", "0.0.0.0", "--allow-open"])
    assert not api_keys(args).enabled
    monkeypatch.setenv("TANDEM_API_KEYS", "tk-0123456789abcdef0123")
    assert api_keys(build_parser().parse_args(["router", "--host", "0.0.0.0"])).enabled


def test_tandem_up_refuses_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    monkeypatch.delenv("TANDEM_ALLOW_OPEN", raising=False)
    assert run(build_parser().parse_args(["up", "--host", "0.0.0.0", "--split"])) == 2
    assert "with no API keys" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "keyed", "served"),
    [
        ([], False, True),  # an open API: one tenant, /metrics beside it
        (["--metrics-port", "0"], False, True),  # and on the operator's port too
        ([], True, False),  # keys (tenants): not on the API port, and said where instead
        (["--metrics-port", "0"], True, False),
        (["--metrics-auth"], True, True),  # the operator lets any key read it
    ],
)
def test_a_keyed_api_port_does_not_serve_metrics(
    flags: list[str], keyed: bool, served: bool
) -> None:
    """Issue 49: /metrics' route counters reveal prefix-cache hits; tenants must not read
    them on the API port unless the operator says so (--metrics-auth)."""
    args = build_parser().parse_args(["router", *flags])
    refusal = metrics_refusal(args, keyed)
    assert (refusal is None) is served
    if refusal is not None:
        assert "--metrics-port" in refusal or "metrics port" in refusal
