"""A stopped service ends within a bound even if a task it left swallows its cancellation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

SERVICE = textwrap.dedent(
    """
    import argparse, asyncio, sys
    import shared.runtime.service as so

    so.LEFTOVER_GRACE = 1.0

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # as ucxx's progress task does

    async def polite() -> None:
        await asyncio.sleep(3600)

    async def serve(args: argparse.Namespace) -> None:
        kept = [asyncio.create_task(polite())]
        if args.stubborn:
            kept.append(asyncio.create_task(stubborn(), name="stubborn"))
        await asyncio.sleep(0.1)
        print("served", flush=True)

    parser = argparse.ArgumentParser()
    parser.add_argument("--stubborn", action="store_true")
    sys.exit(so.run_service(serve, parser.parse_args()))
    """
)


def run(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SERVICE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - started


def test_leftover_tasks_are_cancelled_and_the_service_exits_cleanly() -> None:
    done, _ = run()
    assert done.returncode == 0, done.stderr
    assert "served" in done.stdout and "ignored cancellation" not in done.stderr


def test_a_task_that_swallows_cancellation_is_named_and_the_process_still_ends() -> None:
    done, took = run("--stubborn")
    assert done.returncode == 1, done.stderr
    assert "task stubborn ignored cancellation at shutdown" in done.stderr
    assert "stubborn (<string>:" in done.stderr  # where it was waiting
    assert took < 30  # without the bound, asyncio.run waits for it forever (timeout: 60)
