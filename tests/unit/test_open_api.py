"""An open API (no keys) is refused beyond loopback unless `--allow-open` says so (issue
49): the router's own check, and `tandem up`'s before anything starts."""

from __future__ import annotations

import pytest

from services.router.main import api_keys
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
