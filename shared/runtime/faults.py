"""Test-only fault injection, off unless `TANDEM_FAULT_INJECTION=1` is in a node's
environment: SIGUSR1 hangs the node's engine thread (its event loop, NATS and data plane go
on, as when a step never returns), SIGUSR2 releases it. The tests show that such a node is
found out and its streams move elsewhere (tests/e2e/test_engine_hang.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from shared.runtime.engine_thread import EngineThread

log = logging.getLogger("tandem.faults")


def install(thread: EngineThread) -> bool:
    """Wire the signals to `thread` if fault injection is on; whether it is."""
    if os.environ.get("TANDEM_FAULT_INJECTION") != "1":
        return False
    loop = asyncio.get_running_loop()

    def freeze() -> None:
        log.warning("fault injection: freezing the engine thread")
        thread.freeze()

    def thaw() -> None:
        log.warning("fault injection: releasing the engine thread")
        thread.thaw()

    loop.add_signal_handler(signal.SIGUSR1, freeze)
    loop.add_signal_handler(signal.SIGUSR2, thaw)
    return True
