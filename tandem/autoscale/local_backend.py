"""The local backend: model nodes as child processes of a `tandem up` stack.

A new node is a copy of the stack's first node of that role (same model, transport and
engine options) under a fresh name and metrics port, with its share of the cores as torch
threads. A backend given a model counts, copies and stops that model's nodes alone (one
backend per model: `tandem up --autoscale` with several models); decode processes hosting
every model (`--shared-decode`) are one backend's, for all models. Removing a node sends it
SIGTERM, so a
decode node drains (finishes its streams, takes no new ones) before it exits, and the
routers resume anything left when it leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import threading
from threading import Thread

from shared.bus.server import free_port
from shared.model.source import resolve_model
from tandem.autoscale.controller import run_controller
from tandem.launcher import Child, Stack


def served_name(child: Child) -> str | None:
    """The served name of the model a model node's command names (None: not a model node)."""
    if "--model" not in child.argv:
        return None
    return _served_name(child.argv[child.argv.index("--model") + 1])


@functools.lru_cache(maxsize=64)
def _served_name(option: str) -> str:
    # resolve_model looks at the filesystem; the backends ask for every child every tick
    return resolve_model(option).served_name


class LocalBackend:
    def __init__(
        self, stack: Stack, model: str | None = None, like: LocalBackend | None = None
    ) -> None:
        """`model`: the served name whose nodes this scales (None: every model node). The
        backends of one stack (`like` another) share its lock, since node names are
        numbered across models, and the names asked to stop."""
        self.stack = stack
        self.model = model
        # names asked to stop (they may still be draining)
        self.stopping: set[str] = like.stopping if like else set()
        self.lock: threading.Lock = like.lock if like else threading.Lock()

    def _mine(self, child: Child, role: str) -> bool:
        return child.name.startswith(role + "-") and (
            self.model is None or served_name(child) == self.model
        )

    def _alive(self, role: str) -> list[Child]:
        return [
            c
            for c in self.stack.children
            if self._mine(c, role)
            and c.proc is not None
            and c.proc.poll() is None
            and c.name not in self.stopping
        ]

    def count(self, role: str) -> int:
        return len(self._alive(role))

    def _new_child(self, role: str) -> Child:
        template = next(c for c in self.stack.children if self._mine(c, role))
        taken = {c.name for c in self.stack.children}
        index = 1
        while f"{role}-{index}" in taken:
            index += 1
        name = f"{role}-{index}"
        argv = list(template.argv)
        argv[argv.index("--node-id") + 1] = name
        if "--threads" in argv:  # its share of the cores with one more model node, not the
            every = LocalBackend(self.stack, like=self)  # every model's nodes share the cores
            models = len(every._alive("prefill")) + len(every._alive("decode")) + 1  # template's
            cores = len(os.sched_getaffinity(0))
            argv[argv.index("--threads") + 1] = str(max(1, cores // models))
        port = free_port()
        argv[argv.index("--metrics-port") + 1] = str(port)
        self.stack.metrics_ports[name] = port
        return Child(name, argv)

    def scale_up(self, role: str, n: int) -> list[str]:
        started = []
        with self.lock:
            for _ in range(n):
                child = self._new_child(role)
                self.stack.add(child)
                started.append(child.name)
        return started

    def scale_down(self, role: str, node_ids: list[str]) -> None:
        with self.lock:
            for name in node_ids:
                if any(c.name == name for c in self.stack.children):
                    self.stopping.add(name)
                    self.stack.terminate(name)


def show_decisions() -> None:
    """The controller's lines in the stack's own output, as its other lines are: without a
    handler Python printed only warnings (the infeasible line), and a user of `tandem up
    --autoscale` saw nodes come and go without the reason."""
    said = logging.getLogger("tandem.autoscale")
    if not any(isinstance(h, _Printed) for h in said.handlers):
        out = _Printed()
        out.setFormatter(logging.Formatter("[autoscale] %(message)s"))
        said.addHandler(out)
        said.setLevel(logging.INFO)
        said.propagate = False


class _Printed(logging.Handler):
    """Printed to the stdout of the moment (the stack's other lines go there too)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def start_local(stack: Stack, args: argparse.Namespace, stopping: threading.Event) -> Thread:
    """`tandem up --autoscale`: the controller on a thread of its own, scaling the stack's
    processes until `stopping` is set."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=lambda: (stopping.wait(), loop.call_soon_threadsafe(stop.set)), daemon=True
        ).start()
        auth = stack.auth_for("autoscaler")
        every = LocalBackend(stack)
        models = sorted({m for c in stack.children if (m := served_name(c)) is not None})
        pools = {m: LocalBackend(stack, m, like=every) for m in models}
        # decode processes hosting every model: one pool of processes, every model's
        shared = every if len(pools) > 1 and stack.args.shared_decode else None
        await run_controller(
            args, pools if len(pools) > 1 else every, stack.nats_url, auth, stack.url, stop, shared
        )

    show_decisions()
    thread = threading.Thread(target=lambda: asyncio.run(main()), name="autoscale", daemon=True)
    thread.start()
    return thread
