"""Tests that need a tool from outside Python (kubectl, promtool, network namespaces).

On a developer's machine without the tool such a test skips, saying why. In CI
(`TANDEM_REQUIRE_TOOLS=1`, which `.ci/run` sets after installing every tool) it fails
instead, so a green run never means that the Kubernetes manifests, the dashboards or the
multi-host tests went unchecked.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRED = os.environ.get("TANDEM_REQUIRE_TOOLS", "") not in ("", "0")


def missing_tool(reason: str) -> NoReturn:
    """Skip (fail, in CI) a test whose tool is not here."""
    if REQUIRED:
        pytest.fail(f"{reason} (TANDEM_REQUIRE_TOOLS is set: CI must run this test)")
    pytest.skip(reason)
