"""A fault case of issue 49: the kvcache disk tier's file system fills up.

The disk tier is a sparse memory-mapped file; writing through the map into a hole the file
system cannot fill raises SIGBUS, which killed the node. Now each disk slab's blocks are
reserved (posix_fallocate) as it is handed out, and a refused reservation makes the tier
act full: the block is evicted or dropped, the node serves on.

The store runs in a child process on a 1 MiB tmpfs with a disk tier of 8 MiB: without the
reservation the child dies of SIGBUS; with it, it stores every block it can, never more
than the file system holds, and keeps taking puts.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tools import missing_tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from services.kvcache.store import DISK, MEMORY, BlockStore

    block = 64 * 1024
    store = BlockStore(4 * block, 8 << 20, Path(sys.argv[1]))
    stored = sum(store.put(os.urandom(16), os.urandom(block)) for _ in range(120))
    disk = store.classes[block][DISK]
    print(stored, store.used_bytes(DISK), store.used_bytes(MEMORY), disk.out_of_space)
    """
)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, mounted for the test and unmounted after."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        missing_tool(f"cannot mount a tmpfs here (root with CAP_SYS_ADMIN needed): {done.stderr!r}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_tier_file_system_is_a_full_tier_not_a_dead_node(tiny_disk: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_disk / "kv")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    stored, disk_bytes, memory_bytes, refused = map(int, done.stdout.split())
    assert stored == 120  # every put taken (older blocks evicted to make room)
    assert memory_bytes == 4 * 64 * 1024
    assert 0 < disk_bytes <= 1 << 20  # what the file system holds, not the 8 MiB asked
    assert refused > 0  # the file system said no, and the tier acted as full
