"""A decode engine thread on a core of its own (`--engine-cpus`, `tandem up --isolate-decode`):
the CPU-list option, the thread that moves itself and nothing else, the plan that puts every
other process on the remaining cores, and a real nats-server moved there."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest

from shared.bus.server import NatsServer
from shared.errors import TandemError
from shared.procs import thread_cpus
from shared.runtime.engine_thread import EngineThread
from shared.runtime.options import cpu_list
from tandem.cli import build_parser
from tandem.up import run
from tests.unit.test_colocated import plan_of

pytestmark = pytest.mark.unit

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(
    len(CPUS) < 2, reason=f"needs 2 CPUs to tell one thread's CPUs from the others' ({CPUS})"
)


def test_cpu_list_reads_the_taskset_notation() -> None:
    assert cpu_list("1") == {1}
    assert cpu_list("0,2-3") == {0, 2, 3}
    assert cpu_list(" 4 , 6-6") == {4, 6}
    for bad in ("", "a", "3-1", "-1", "1,,2", "1-x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cpu_list(bad)


def test_a_node_refuses_a_bad_engine_cpus_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--engine-cpus", "1-0"])
    assert "not a CPU range" in capsys.readouterr().err
    args = build_parser().parse_args(["decode", "--engine-cpus", "0"])
    assert args.engine_cpus == {0}


@needs_two
def test_the_engine_thread_moves_itself_and_nothing_else() -> None:
    async def main() -> tuple[set[int], set[int]]:
        thread = EngineThread({CPUS[-1]})
        try:
            await thread.pin()
            return await thread.call(os.sched_getaffinity, 0), os.sched_getaffinity(0)
        finally:
            thread.close()

    engine, caller = asyncio.run(main())
    assert engine == {CPUS[-1]}
    assert caller == set(CPUS)  # the event loop's thread keeps the process's CPUs
    assert os.sched_getaffinity(0) == set(CPUS)


def test_an_engine_cpu_the_host_lacks_is_a_clear_error() -> None:
    async def main() -> set[int]:
        thread = EngineThread({4095})
        try:
            with pytest.raises(TandemError, match=r"CPUs \[4095\]"):
                await thread.pin()
            return await thread.call(os.sched_getaffinity, 0)  # still serves, as it was
        finally:
            thread.close()

    assert asyncio.run(main()) == set(CPUS)


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@needs_two
def test_isolate_decode_gives_the_engine_a_core_and_everything_else_the_rest() -> None:
    stack, children = plan_of("--prefill", "1", "--decode", "1", "--isolate-decode")
    rest = set(CPUS[:-1])
    assert stack.engine_cpus == {"decode-1": {CPUS[-1]}}
    assert stack.shared_cpus == rest
    assert stack.affinity == {n: rest for n in ("router", "kvcache-1", "prefill-1", "decode-1")}
    assert option(children["decode-1"], "--engine-cpus") == str(CPUS[-1])
    assert option(children["decode-1"], "--threads") == "1"  # its one core
    assert option(children["prefill-1"], "--engine-cpus") is None
    assert option(children["prefill-1"], "--threads") == str(len(rest))
    # without the option nothing is placed
    stack, children = plan_of("--prefill", "1", "--decode", "1")
    assert stack.affinity == {} and stack.shared_cpus is None
    assert all(option(argv, "--engine-cpus") is None for argv in children.values())


def test_isolate_decode_needs_a_core_left_for_the_rest() -> None:
    with pytest.raises(SystemExit, match="more CPUs than decode nodes"):
        plan_of("--decode", str(len(CPUS)), "--isolate-decode")


def test_up_refuses_isolate_decode_with_other_placements(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for other in ("--pin-cores", "--autoscale"):
        assert run(build_parser().parse_args(["up", "--isolate-decode", other])) == 2
        assert "--isolate-decode" in capsys.readouterr().err


@needs_two
def test_nats_server_moves_with_all_its_threads() -> None:
    with NatsServer() as server:
        assert server.proc is not None
        assert all(cpus == set(CPUS) for cpus in thread_cpus(server.proc.pid))
        server.run_on({CPUS[0]})
        threads = thread_cpus(server.proc.pid)
        assert len(threads) > 1 and all(cpus == {CPUS[0]} for cpus in threads)
