"""Tandem processes ask torch for transparent huge pages unless the operator said no."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import tandem.cli, os, torch; t = torch.ones(64 << 20); "
    "huge = open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split()[0]; "
    "print(os.environ['THP_MEM_ALLOC_ENABLE'], huge)"
)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def setting(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=clean | env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_on_by_default_and_off_when_the_operator_says_so() -> None:
    on, huge_kb = setting().split()
    assert on == "1"
    off, none_kb = setting(THP_MEM_ALLOC_ENABLE="0").split()
    assert off == "0" and none_kb == "0"
    if "[never]" in THP_MODE.read_text():
        print("this kernel has transparent huge pages off: not checking that torch got some")
    else:  # the 256 MB tensor sits in huge pages
        assert int(huge_kb) >= 128 << 10
