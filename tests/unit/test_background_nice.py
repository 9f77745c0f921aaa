"""`tandem up --background-nice`: the prefill and kvcache nodes run at a lower priority than
the decode nodes, router and NATS (the option, the plan per role, and a real child process
started the way the launcher starts its services)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from shared.procs import BACKGROUND_NICE, child_setup
from tandem.cli import build_parser
from tests.unit.test_colocated import plan_of

pytestmark = pytest.mark.unit


def test_the_option_takes_0_to_19_and_refuses_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert build_parser().parse_args(["up"]).background_nice == BACKGROUND_NICE == 10
    assert build_parser().parse_args(["up", "--background-nice", "0"]).background_nice == 0
    assert build_parser().parse_args(["up", "--background-nice", "19"]).background_nice == 19
    for bad, why in (("20", "between 0 and 19"), ("-5", "between 0 and 19"), ("x", "whole")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", "--background-nice", bad])
        assert why in capsys.readouterr().err


def test_prefill_and_kvcache_nodes_get_it_and_nothing_else_does() -> None:
    stack, _ = plan_of("--prefill", "2", "--decode", "1", "--kvcache", "1", "--conditional")
    nice = {c.name: stack.nice(c) for c in stack.plan()}
    assert nice == {
        "router": 0,
        "kvcache-1": 10,
        "prefill-1": 10,
        "prefill-2": 10,
        "decode-1": 0,
    }
    stack, _ = plan_of("--colocated", "--background-nice", "0")
    assert all(stack.nice(c) == 0 for c in stack.plan())


def test_a_child_started_as_the_launcher_does_runs_at_that_niceness() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base + 5 > 19:
        pytest.skip(f"this process already runs at niceness {base}: no room to raise it")
    script = "import os, sys; sys.stdout.write(str(os.getpriority(os.PRIO_PROCESS, 0)))"
    for nice, want in ((5, base + 5), (0, base)):
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
            preexec_fn=functools.partial(child_setup, None, nice),
        )
        assert int(out.stdout) == want
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the parent's own is unchanged
