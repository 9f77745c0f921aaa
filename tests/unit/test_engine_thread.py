"""A node builds its engine on the thread that runs it, so its process keeps one OpenMP team.

Each thread that starts an OpenMP parallel region gets a team of its own in libgomp; with
more team threads than cores, every team sleeps at its barriers, and steps ran 1.2-1.5x
slower in the serving stack (shared/runtime/engine_thread.py). The test counts the
process's native threads that Python does not know (OpenMP's workers among them). The
control builds the engine on the main thread, as the nodes did before, and must show the
second team.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import argparse, asyncio, os, sys, threading
from shared.runtime.options import add_engine_node_parser
from shared.runtime.engine import engine_from_args, start_engine
from shared.runtime.engine_thread import EngineThread
from shared.sampling_params import SamplingParams

parser = argparse.ArgumentParser()
add_engine_node_parser(parser.add_subparsers(), "decode", "")
args = parser.parse_args(
    ["decode", "--model", sys.argv[1], "--threads", "2", "--kv-cache-mb", "64"]
)

def unknown_threads():
    return len(os.listdir("/proc/self/task")) - threading.active_count()

async def main(where):
    before = unknown_threads()
    if where == "engine thread":
        engine, thread = await start_engine(args)
    else:
        engine, thread = engine_from_args(args), EngineThread()
    def serve():
        engine.add_request(list(range(5, 300)), SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished():
            engine.step()
    await thread.call(serve)
    print(unknown_threads() - before)
    thread.close()

asyncio.run(main(sys.argv[2]))
"""


def openmp_workers(model_dir: Path, where: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), where],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_engine_built_on_its_thread_keeps_one_openmp_team(tiny_model_dir: Path) -> None:
    # Loading starts a few native threads of its own (the same in both cases); built on the
    # main thread (the old way), the load also leaves a second team's worker behind.
    on_engine_thread = openmp_workers(tiny_model_dir, "engine thread")
    on_main_thread = openmp_workers(tiny_model_dir, "main thread")
    assert on_main_thread == on_engine_thread + 1
