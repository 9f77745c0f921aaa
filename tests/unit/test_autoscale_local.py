"""The local autoscaler backend: a new node gets its share of the cores, not the template's;
with several models, each model's backend scales its own nodes; TTFT per model."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.autoscale.controller import ttft_buckets
from tandem.autoscale.local_backend import LocalBackend, served_name
from tandem.cli import build_parser
from tandem.launcher import Child, Stack


@contextlib.contextmanager
def stand_ins(stack: Stack) -> Iterator[None]:
    """The stack's planned children, and any it starts, as `sleep` processes (not model
    nodes), killed on the way out."""
    sleepers: list[subprocess.Popen[str]] = []

    def spawn(child: Child) -> None:
        child.proc = subprocess.Popen(["sleep", "60"], text=True)
        sleepers.append(child.proc)

    try:
        for child in stack.children:
            spawn(child)
        stack._spawn = spawn  # type: ignore[method-assign]
        yield
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_new_node_gets_its_share_of_the_cores() -> None:
    stack = Stack(build_parser().parse_args(["up", "--prefill", "1", "--decode", "1"]))
    stack.children = stack.plan()
    with stand_ins(stack):
        template = next(c for c in stack.children if c.name == "decode-1")
        cores = len(os.sched_getaffinity(0))
        assert template.argv[template.argv.index("--threads") + 1] == str(max(1, cores // 2))
        child = LocalBackend(stack)._new_child("decode")
        assert child.name == "decode-2"
        assert child.argv[child.argv.index("--threads") + 1] == str(max(1, cores // 3))
        assert child.argv[child.argv.index("--node-id") + 1] == "decode-2"


def test_each_models_backend_counts_copies_and_stops_its_own_nodes(tiny_model_dir: Path) -> None:
    """`tandem up --autoscale` with two models: one backend per model, sharing the names."""
    argv = ["up", "--model", "smollm2-135m-instruct", "--model", f"tiny={tiny_model_dir}"]
    stack = Stack(build_parser().parse_args([*argv, "--prefill", "1", "--decode", "1"]))
    stack.children = stack.plan()
    assert {served_name(c) for c in stack.children} == {"smollm2-135m-instruct", "tiny", None}
    with stand_ins(stack):
        every = LocalBackend(stack)
        tiny = LocalBackend(stack, "tiny", like=every)
        smol = LocalBackend(stack, "smollm2-135m-instruct", like=every)
        assert (every.count("decode"), tiny.count("decode"), smol.count("decode")) == (2, 1, 1)
        started = tiny.scale_up("decode", 1)
        assert started == ["decode-3"]  # numbered after both models' nodes
        new = next(c for c in stack.children if c.name == "decode-3")
        assert new.argv[new.argv.index("--model") + 1] == f"tiny={tiny_model_dir}"
        assert (tiny.count("decode"), smol.count("decode")) == (2, 1)
        cores = len(os.sched_getaffinity(0))  # its share with all five model nodes
        assert new.argv[new.argv.index("--threads") + 1] == str(max(1, cores // 5))
        tiny.scale_down("decode", ["decode-3"])
        assert (tiny.count("decode"), smol.count("decode"), every.count("decode")) == (1, 1, 2)


def test_ttft_is_read_for_one_models_pool_or_all() -> None:
    text = "\n".join(
        f'tandem_time_to_first_token_seconds_bucket{{le="{le}",model="{m}"}} {n}'
        for m, counts in (("a", (1, 3)), ("b", (2, 2)))
        for le, n in zip(("0.5", "+Inf"), counts, strict=True)
    )
    text = "# TYPE tandem_time_to_first_token_seconds histogram\n" + text + "\n"
    assert ttft_buckets(text) == {0.5: 3.0, float("inf"): 5.0}
    assert ttft_buckets(text, "a") == {0.5: 1.0, float("inf"): 3.0}
    assert ttft_buckets(text, "c") == {}


def test_shared_decode_processes_are_one_pool_whose_copies_host_every_model(
    tiny_model_dir: Path,
) -> None:
    """`tandem up --shared-decode --autoscale`: the decode processes, each hosting both
    models, are counted and copied as one pool (the backend start_local gives the decode
    controller), and a copy hosts both models too."""
    argv = ["up", "--model", "smollm2-135m-instruct", "--model", f"tiny={tiny_model_dir}"]
    args = [*argv, "--prefill", "1", "--decode", "1", "--shared-decode", "--autoscale"]
    stack = Stack(build_parser().parse_args(args))
    stack.children = stack.plan()
    with stand_ins(stack):
        every = LocalBackend(stack)
        assert every.count("decode") == 1 and every.count("prefill") == 2
        assert every.scale_up("decode", 1) == ["decode-2"]
        new = stack.child("decode-2")
        models = [new.argv[i + 1] for i, a in enumerate(new.argv) if a == "--model"]
        assert models == ["smollm2-135m-instruct", f"tiny={tiny_model_dir}"]
        assert every.count("decode") == 2


def test_tandem_up_prints_the_autoscalers_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from tandem.autoscale.local_backend import show_decisions

    said = logging.getLogger("tandem.autoscale")
    before = list(said.handlers)
    try:
        show_decisions()
        show_decisions()  # once only
        said.info("autoscale %s %+d: %s", "decode", 1, "the planner sizes ...")
        assert capsys.readouterr().out == "[autoscale] autoscale decode +1: the planner sizes ...\n"
    finally:
        said.handlers = before
        said.propagate = True
