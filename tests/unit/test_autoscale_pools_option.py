"""`tandem autoscale --pool MODEL=PREFILL:DECODE`: each model's compose services or
Deployments, parsed with a clear error for a malformed or repeated one."""

from __future__ import annotations

import pytest

from tandem.autoscale.command import parse_pools

pytestmark = pytest.mark.unit


def test_pools_name_each_models_services() -> None:
    assert parse_pools(None) == {}
    assert parse_pools(["smol=prefill:decode", " smol-bf16 = prefill-second : decode-second"]) == {
        "smol": {"prefill": "prefill", "decode": "decode"},
        "smol-bf16": {"prefill": "prefill-second", "decode": "decode-second"},
    }


@pytest.mark.parametrize(
    "bad",
    ["smol", "smol=prefill", "=prefill:decode", "smol=:decode", "smol=prefill:", "a=b:c:d"],
)
def test_a_malformed_pool_is_an_error_naming_it(bad: str) -> None:
    with pytest.raises(SystemExit, match=r"expected MODEL=PREFILL:DECODE") as exc:
        parse_pools([bad])
    assert repr(bad) in str(exc.value)


def test_a_model_named_twice_is_an_error() -> None:
    with pytest.raises(SystemExit, match="names model 'smol' twice"):
        parse_pools(["smol=prefill:decode", "smol=p2:d2"])
