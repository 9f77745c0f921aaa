"""A service's start-up objects leave the collector's walks; its garbage by then is freed.
The load generator does the same for the length of a run only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# In a child process: freezing is for the life of a process, not for the test runner's.
SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    from shared.runtime.service import freeze_startup_objects

    class Node:
        pass

    kept = [Node() for _ in range(1000)]  # what a service loaded: alive for good
    cycle = Node()
    cycle.me = cycle  # garbage only the collector frees
    dead = weakref.ref(cycle)
    del cycle
    gc.disable()  # no automatic collection between here and the helper's own
    freeze_startup_objects()
    tracked = {id(o) for o in gc.get_objects()}
    print(dead() is None, gc.get_freeze_count() >= 1000, any(id(n) in tracked for n in kept))
    """
)


def test_startup_objects_are_frozen_after_the_garbage_is_collected() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    collected, frozen, still_walked = out.stdout.split()
    assert collected == "True"  # the cycle made before start-up ended is not kept forever
    assert frozen == "True"
    assert still_walked == "False"  # later collections no longer walk the loaded objects


def test_objects_are_frozen_for_a_block_only() -> None:
    import gc

    from shared.runtime.service import objects_frozen

    before = gc.get_freeze_count()
    with objects_frozen():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before  # the runner's heap is collected as before
