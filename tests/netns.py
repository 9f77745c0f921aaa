"""Network-namespace lab for multi-host tests: each "host" is its own netns, joined by a bridge.

Layout: a hub namespace holds a Linux bridge; every host gets a namespace with `lo` up and
`eth0` (the next address of a private 10.213.<n>.0/24), whose veth peer sits on the bridge.
`Host.link_down()` downs the hub-side peer: the host keeps its address and route but loses
carrier, so packets are silently dropped (a pulled cable: established TCP stalls, no RST).

SAFETY: the root namespace routes the test subnet off the machine. Never send a packet to a lab
address from the root namespace: every participant, the test's client included, must run inside
the lab's namespaces (`Host.popen` / `Host.run`). The harness itself creates nothing in the root
namespace (veth pairs are created inside the hub), and on exit it SIGKILLs every process left in
its namespaces and deletes them. Names all start with `tnd<4 hex>-`; a lock file per lab in
/run/tandem-netns tells live labs from crashed ones, whose leftovers the next lab sweeps away.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = ["CommandError", "Host", "NetnsLab", "unavailable_reason"]

LOCK_DIR = "/run/tandem-netns"
_LAB_NS = re.compile(r"^(tnd[0-9a-f]{4})-")
_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,11}$")  # hub-side veth is "v-<name>" <= 15 chars
_IP_TIMEOUT = 10.0


class CommandError(subprocess.CalledProcessError):
    """A failed command whose message carries its stderr."""

    def __str__(self) -> str:
        err = (
            self.stderr.decode(errors="replace") if isinstance(self.stderr, bytes) else self.stderr
        )
        return f"{super().__str__()}: {(err or '').strip() or '(no stderr)'}"


def _run(argv: list[str], timeout: float = _IP_TIMEOUT, **kwargs: Any) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise CommandError(proc.returncode, argv, proc.stdout, proc.stderr)
    return str(proc.stdout)


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_ns_processes(ns: str) -> None:
    """SIGKILL everything whose network namespace is `ns` (a few rounds, in case of forks)."""
    for _ in range(5):
        try:
            pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
        except CommandError:
            return  # namespace already gone
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_ns(ns: str) -> None:
    _kill_ns_processes(ns)
    with contextlib.suppress(CommandError):
        _run(["ip", "netns", "delete", ns])


def _sweep_stale() -> None:
    """Delete namespaces and lock files of labs whose owning process is gone."""
    names = _list_netns()
    prefixes = {m.group(1) for n in names if (m := _LAB_NS.match(n))}
    with contextlib.suppress(FileNotFoundError):
        prefixes |= {f[:-5] for f in os.listdir(LOCK_DIR) if f.endswith(".lock")}
    for prefix in sorted(prefixes):
        path = os.path.join(LOCK_DIR, f"{prefix}.lock")
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1  # namespaces without a lock file: a crash before the file was written
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live lab holds it
                if os.fstat(fd).st_nlink == 0:
                    continue  # another sweeper already handled this one
            for ns in names:
                if ns.startswith(prefix + "-"):
                    _delete_ns(ns)
            if fd >= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            if fd >= 0:
                os.close(fd)


@dataclass
class Host:
    """One machine of the lab: a namespace with `eth0` at `ip`."""

    name: str
    ns: str
    ip: str
    hub_ns: str = field(repr=False)
    hub_if: str = field(repr=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False, compare=False)

    def _argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside this host (`ip netns exec` execs it, so the pid is the program's)."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self._argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run `argv` inside this host; defaults: check, captured text output, 30 s timeout."""
        check = kwargs.pop("check", True)
        kwargs.setdefault("timeout", 30.0)
        kwargs.setdefault("text", True)
        if "stdout" not in kwargs and "stderr" not in kwargs:
            kwargs.setdefault("capture_output", True)
        full = self._argv(argv)
        proc: subprocess.CompletedProcess[Any] = subprocess.run(full, **kwargs)
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, full, proc.stdout, proc.stderr)
        return proc

    def link_down(self) -> None:
        """Pull the cable: down the bridge-side veth end (host sees NO-CARRIER, packets vanish)."""
        _run(["ip", "-n", self.hub_ns, "link", "set", self.hub_if, "down"])

    def link_up(self) -> None:
        """Plug the cable back in."""
        _run(["ip", "-n", self.hub_ns, "link", "set", self.hub_if, "up"])


class NetnsLab:
    """Context manager owning a hub namespace with a bridge, plus one namespace per host."""

    def __init__(self) -> None:
        self.prefix = ""
        self.subnet_base = f"10.213.{random.randint(1, 254)}"
        self.subnet = f"{self.subnet_base}.0/24"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._lock_fd = -1

    @property
    def hub_ns(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this lab created (and has not yet deleted)."""
        return list(self._namespaces)

    def __enter__(self) -> NetnsLab:
        os.makedirs(LOCK_DIR, exist_ok=True)
        _sweep_stale()
        self._claim_prefix()
        try:
            self._add_ns(self.hub_ns)
            _run(["ip", "-n", self.hub_ns, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub_ns, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _claim_prefix(self) -> None:
        existing = {m.group(1) for n in _list_netns() if (m := _LAB_NS.match(n))}
        for _ in range(100):
            prefix = f"tnd{secrets.token_hex(2)}"
            if prefix in existing:
                continue
            try:
                fd = os.open(
                    os.path.join(LOCK_DIR, f"{prefix}.lock"), os.O_RDWR | os.O_CREAT | os.O_EXCL
                )
            except FileExistsError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.prefix, self._lock_fd = prefix, fd
            return
        raise RuntimeError("could not find a free netns lab prefix")

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)

    def add_host(self, name: str) -> Host:
        """Create host `name` (lowercase, <= 12 chars) with `eth0` at the next subnet address."""
        if not self.prefix:
            raise RuntimeError("NetnsLab.add_host() called outside the `with` block")
        if not _HOST_NAME.match(name) or name == "hub" or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        if len(self.hosts) >= 253:
            raise RuntimeError("subnet full")
        ns, hub_if = f"{self.prefix}-{name}", f"v-{name}"
        ip = f"{self.subnet_base}.{len(self.hosts) + 1}"
        self._add_ns(ns)
        hub = ["ip", "-n", self.hub_ns, "link"]
        _run([*hub, "add", hub_if, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run([*hub, "set", hub_if, "master", "br0"])
        _run([*hub, "set", hub_if, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        host = Host(name=name, ns=ns, ip=ip, hub_ns=self.hub_ns, hub_if=hub_if)
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them; idempotent, never raises."""
        for ns in reversed(self._namespaces):
            with contextlib.suppress(Exception):
                _delete_ns(ns)
        self._namespaces.clear()
        for host in self.hosts.values():
            for proc in host._procs:
                with contextlib.suppress(Exception):
                    proc.kill()  # normally already dead; reap it so it is no zombie
                    proc.wait(timeout=5)
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(LOCK_DIR, f"{self.prefix}.lock"))
            os.close(self._lock_fd)
            self._lock_fd = -1


def unavailable_reason() -> str | None:
    """None if a lab can be built here, else why not (for `pytest.skip`)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` binary (iproute2) is not installed"
    try:
        with NetnsLab() as lab:
            lab.add_host("probe")
    except Exception as e:
        return f"cannot build a network-namespace lab here: {e}"
    return None
