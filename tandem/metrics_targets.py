"""`tandem up --prometheus-targets FILE`: a Prometheus file_sd list of the stack's processes.

The launcher (tandem/launcher.py) says which processes run; this keeps FILE listing them:
written before anything starts (an unwritable path stops `tandem up` with the reason),
rewritten only when the list changes (a node started, or exited: the autoscaler adds and
removes them), each time whole (a new file renamed over the old, which Prometheus re-reads),
and removed when the stack stops. deploy/observability/ runs Prometheus, Grafana and Jaeger
on it (docs/observability.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

Groups = list[dict[str, Any]]


class TargetsFile:
    """The file and what it last held. Its own lock: the autoscaler's thread adds nodes
    while the main loop notices exits."""

    def __init__(self, path: Path, say: Callable[[str], None]) -> None:
        self.path = path
        self.say = say
        self.lock = threading.Lock()
        self.written: Groups | None = None  # None: no file of ours
        self.error = ""  # the last failure to rewrite it, said once
        self.closed = False  # removed: written no more

    def open(self, groups: Groups) -> None:
        """The first write (RuntimeError, with the reason, if it cannot be made)."""
        self.closed = False
        try:
            self._write(lambda: groups)
        except OSError as exc:
            raise RuntimeError(
                f"cannot write the Prometheus targets {self.path}: {exc} (a directory "
                "Docker created for a bind mount is root's: create it first)"
            ) from exc

    def refresh(self, groups: Callable[[], Groups]) -> None:
        """Rewrite it for a running stack: a failure is said once and retried at the next
        change or poll, never fatal (the stack serves without its metrics listed)."""
        try:
            self._write(groups)
            self.error = ""
        except OSError as exc:
            if str(exc) != self.error:
                self.error = str(exc)
                self.say(f"[up] cannot rewrite the Prometheus targets: {exc}")

    def remove(self) -> None:
        with self.lock:
            self.closed = True
            if self.written is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                self.written = None

    def _write(self, groups: Callable[[], Groups]) -> None:
        with self.lock:
            if self.closed:  # an autoscaler still finishing must not bring it back
                return
            now = groups()
            if now != self.written:
                write_atomically(self.path, json.dumps(now, indent=2) + "\n")
                self.written = now


def scrape_address(host: str, port: int) -> str:
    """Where a Prometheus on this machine reaches a port listening on `host`: a wildcard
    address through the loopback; an IPv6 address in brackets."""
    # a listening address, not one bound here
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_atomically(path: Path, text: str) -> None:
    """`text` as `path`'s whole content, or `path` unchanged: written beside it, then renamed
    over it, so Prometheus (which re-reads the file on every change) never reads half of
    one. The temporary name ends in .tmp, which a `*.json` file_sd pattern never matches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600: Prometheus' container runs as another user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
