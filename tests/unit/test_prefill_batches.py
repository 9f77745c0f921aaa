"""A prefill node's batches. `--idle-threads`: what `tandem up` gives its prefill nodes
(every core where nodes share them, 0 where they are kept apart), the option's range, and
the thread count a batch runs on (set for the block, then back; OpenMP keeps it per
thread). `--max-batch`: the jobs it fetches together, and `--step-tokens`: the prompt tokens of one
of its steps, limits the simulator shares."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from shared.runtime.engine import torch_threads
from shared.runtime.options import PREFILL_MAX_BATCH, PREFILL_STEP_TOKENS
from tandem.cli import build_parser
from tests.unit.test_colocated import plan_of

pytestmark = pytest.mark.unit

CORES = len(os.sched_getaffinity(0))


def idle_threads(argv: list[str]) -> int:
    return int(argv[argv.index("--idle-threads") + 1])


def test_up_gives_prefill_nodes_every_core_where_nodes_share_them() -> None:
    _, children = plan_of("--prefill", "2", "--decode", "1")
    assert [idle_threads(children[n]) for n in ("prefill-1", "prefill-2")] == [CORES, CORES]
    assert "--idle-threads" not in children["decode-1"] + children["router"]
    _, children = plan_of("--pin-cores")
    assert idle_threads(children["prefill-1"]) == 0  # its own core only
    _, children = plan_of("--prefill-idle-threads", "3")
    assert idle_threads(children["prefill-1"]) == 3
    _, children = plan_of("--prefill-idle-threads", "0")
    assert idle_threads(children["prefill-1"]) == 0


def test_up_with_isolated_decode_takes_no_core_of_the_decode_node() -> None:
    if CORES < 2:
        pytest.skip(f"one CPU ({CORES}): --isolate-decode needs two")
    _, children = plan_of("--isolate-decode")
    assert idle_threads(children["prefill-1"]) == 0


def test_the_options_refuse_a_count_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["prefill", "--idle-threads", "2"]).idle_threads == 2
    assert build_parser().parse_args(["prefill"]).idle_threads == 0
    cases = (
        (["prefill", "--idle-threads", "-1"], "between 0 and 1024"),
        (["up", "--prefill-idle-threads", "x"], "whole number"),
    )
    for argv, why in cases:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert why in capsys.readouterr().err


def test_a_batch_runs_on_the_count_asked_then_the_thread_goes_back() -> None:
    seen: dict[str, int] = {}

    def engine_thread() -> None:  # a fresh thread, as a node's engine thread
        torch.set_num_threads(1)
        with torch_threads(2) as used:
            seen["inside"], seen["used"] = torch.get_num_threads(), used
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # a parallel region runs
        seen["after"] = torch.get_num_threads()
        with torch_threads(0) as used:  # 0: as set
            seen["kept"], seen["kept_used"] = torch.get_num_threads(), used

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    assert seen == {"inside": 2, "used": 2, "after": 1, "kept": 1, "kept_used": 1}


def test_a_prefill_nodes_batch_limit_is_an_option_the_simulator_shares(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem prefill --max-batch` (TANDEM_MAX_BATCH in the environment, as `tandem up`'s
    children and compose's containers get it); the simulator's default is the node's, and
    `tandem plan validate` gives the measured nodes the simulated limit."""
    from tandem.plan.topology import Topology
    from tandem.plan.validate import engine_env

    assert build_parser().parse_args(["prefill"]).max_batch == PREFILL_MAX_BATCH == 4
    assert build_parser().parse_args(["prefill", "--max-batch", "1"]).max_batch == 1
    for bad, why in (("0", "at least 1"), ("x", "whole number")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["prefill", "--max-batch", bad])
        assert why in capsys.readouterr().err
    assert Topology().prefill_max_batch == PREFILL_MAX_BATCH
    simulated = build_parser().parse_args(["plan", "simulate", "--profile", "p.json"])
    assert simulated.prefill_max_batch == PREFILL_MAX_BATCH
    assert engine_env(simulated)["TANDEM_MAX_BATCH"] == str(PREFILL_MAX_BATCH)
    monkeypatch.setenv("TANDEM_MAX_BATCH", "8")
    assert build_parser().parse_args(["prefill"]).max_batch == 8


def test_a_prefill_nodes_step_tokens_are_an_option_the_simulator_shares(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem prefill --step-tokens` (TANDEM_STEP_TOKENS): the simulated prefill engine's
    steps follow it (the smaller of it and --max-batched-tokens, as the node takes them),
    and `tandem plan validate` gives the measured nodes the simulated cap."""
    from tandem.plan.simulate import engine_shape
    from tandem.plan.validate import engine_env
    from tests.unit.test_plan_simulate import profile

    assert build_parser().parse_args(["prefill"]).step_tokens == PREFILL_STEP_TOKENS
    assert build_parser().parse_args(["prefill", "--step-tokens", "512"]).step_tokens == 512
    for bad, why in (("0", "at least 1"), ("x", "whole number")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["prefill", "--step-tokens", bad])
        assert why in capsys.readouterr().err
    simulate = ["plan", "simulate", "--profile", "p.json", "--prefill-step-tokens", "700"]
    simulated = build_parser().parse_args(simulate)
    assert engine_env(simulated)["TANDEM_STEP_TOKENS"] == "700"
    assert engine_shape(simulated, profile(), prefill=True).max_num_batched_tokens == 700
    assert engine_shape(simulated, profile(), prefill=False).max_num_batched_tokens == 4096
    monkeypatch.setenv("TANDEM_STEP_TOKENS", "1024")
    assert build_parser().parse_args(["prefill"]).step_tokens == 1024
