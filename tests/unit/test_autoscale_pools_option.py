"""`tandem autoscale --pool MODEL=PREFILL:DECODE`: each model's compose services or
Deployments, parsed with a clear error for a malformed or repeated one."""

from __future__ import annotations

import pytest

from tandem.autoscale.command import parse_pools, shared_decode_service

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


def test_pools_naming_one_decode_service_share_it() -> None:
    shared = parse_pools(["a=prefill:decode", "b=prefill-second:decode"])
    assert shared_decode_service(shared) == "decode"
    own = parse_pools(["a=prefill:decode", "b=prefill-second:decode-second"])
    assert shared_decode_service(own) is None
    assert shared_decode_service(parse_pools(["a=prefill:decode"])) is None
    partly = parse_pools(["a=p:decode", "b=p2:decode", "c=p3:decode-c"])
    with pytest.raises(SystemExit, match="shared by some models only"):
        shared_decode_service(partly)
