"""The local autoscaler backend's new node gets its share of the cores, not the template's."""

from __future__ import annotations

import os
import subprocess

from tandem.autoscale.local_backend import LocalBackend
from tandem.cli import build_parser
from tandem.launcher import Stack


def test_a_new_node_gets_its_share_of_the_cores() -> None:
    stack = Stack(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1"]))
    stack.children = stack.plan()
    sleepers = []
    try:
        for child in stack.children:  # stand-ins for the running services
            child.proc = subprocess.Popen(["sleep", "60"], text=True)
            sleepers.append(child.proc)
        template = next(c for c in stack.children if c.name == "decode-1")
        cores = len(os.sched_getaffinity(0))
        assert template.argv[template.argv.index("--threads") + 1] == str(max(1, cores // 2))
        child = LocalBackend(stack)._new_child("decode")
        assert child.name == "decode-2"
        assert child.argv[child.argv.index("--threads") + 1] == str(max(1, cores // 3))
        assert child.argv[child.argv.index("--node-id") + 1] == "decode-2"
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
