"""A process's memory as Linux counts it (/proc/<pid>/status), for tests and benchmarks."""

from __future__ import annotations


def status_kib(field: str, pid: int | str = "self") -> int:
    """One field of /proc/<pid>/status in KiB: VmRSS, RssAnon, RssShmem..."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def rss_mib(pid: int | str = "self") -> float:
    """The process's resident set, MiB."""
    return status_kib("VmRSS", pid) / 1024
