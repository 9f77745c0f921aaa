"""Issue 49: with API keys configured (tenants), each key's cached prefixes are its own by
default, so no tenant learns from its time to first token what another sent; an open API
(one tenant) shares them; `--cache-isolation` overrides either way."""

from __future__ import annotations

import pytest

from services.router.main import config_of
from tandem.cli import build_parser


@pytest.mark.parametrize(
    ("flags", "keyed", "isolated"),
    [
        ([], True, True),  # keys configured: isolated by default
        ([], False, False),  # open API: one tenant, shared
        (["--cache-isolation", "shared"], True, False),  # the operator's explicit choice
        (["--cache-isolation", "key"], False, True),
        (["--cache-isolation", "auto"], True, True),
    ],
)
def test_cache_isolation_follows_the_keys(flags: list[str], keyed: bool, isolated: bool) -> None:
    args = build_parser().parse_args(["router", *flags])
    assert config_of(args, "r", keyed=keyed).isolate_cache_by_key is isolated


def test_an_unknown_isolation_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--cache-isolation", "tenant"])
