"""`--engine vllm` where it is decided without vLLM itself: what `tandem up` refuses and
starts, which python a node runs on, what the vLLM environment installs, and the router's
refusal of grammars for a model only vLLM nodes serve. vLLM's engine itself runs in
tests/e2e/test_vllm_engine.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from shared.engine.vllm.params import schema_of, unsupported
from shared.grammar import grammar_for
from shared.sampling_params import SamplingParams
from tandem.cli import build_parser
from tandem.launcher import Stack, prefill_nodes
from tandem.mode import choose_mode, mode_problem
from tandem.vllm_env import python_for, runtime_requirements

pytestmark = pytest.mark.unit


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


@pytest.mark.parametrize("flags", [["--split"], ["--conditional"], ["--prefill", "2"]])
def test_up_refuses_prefill_nodes_on_vllm(flags: list[str]) -> None:
    problem = mode_problem(up_args("--engine", "vllm", *flags))
    assert problem is not None and "colocated only" in problem


def test_up_refuses_several_models_in_one_vllm_process() -> None:
    models = ["--model", "a=smollm2-135m-instruct", "--model", "b=smollm2-135m-instruct"]
    assert mode_problem(up_args("--engine", "vllm", *models)) is None  # a process each
    problem = mode_problem(up_args("--engine", "vllm", "--shared-decode", *models))
    assert problem is not None and "one model a process" in problem


def test_up_on_vllm_is_colocated_and_its_decode_nodes_run_vllm(tmp_path: Path) -> None:
    args = up_args("--engine", "vllm", "--decode", "2")
    assert mode_problem(args) is None
    assert "colocated" in choose_mode(args)  # no profile measured: nothing to choose
    assert prefill_nodes(args) == 0
    children = Stack(args).plan()
    decodes = [c for c in children if c.argv[0] == "decode"]
    assert len(decodes) == 2 and not [c for c in children if c.argv[0] == "prefill"]
    assert all(c.argv[c.argv.index("--engine") + 1] == "vllm" for c in decodes)
    router = next(c for c in children if c.argv[0] == "router")
    assert "--colocated" in router.argv and "--engine" not in router.argv


def test_native_stacks_run_on_this_python_and_vllm_nodes_on_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert python_for(["decode", "--model", "m"]) == sys.executable
    assert python_for(["decode", "--engine", "native"]) == sys.executable
    missing = tmp_path / "none" / "bin" / "python"
    monkeypatch.setenv("TANDEM_VLLM_PYTHON", str(missing))
    with pytest.raises(RuntimeError, match="make vllm"):
        python_for(["decode", "--engine", "vllm"])
    missing.parent.mkdir(parents=True)
    missing.touch()
    assert python_for(["decode", "--engine", "vllm"]) == str(missing)


def test_the_vllm_environment_takes_tandems_runtime_but_vllms_own_pins() -> None:
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in runtime_requirements()}
    assert {"nats-py", "ucxx-cu12", "structlog", "msgspec", "aiohttp"} <= names
    assert not names & {"torch", "transformers", "llguidance"}


def test_a_response_format_goes_to_vllm_as_its_schema_and_does_not_resume() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    guide = grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})
    assert schema_of(guide) == schema
    params = SamplingParams(max_tokens=8, guide=guide)
    assert unsupported(params) is None
    why = unsupported(params, already=3)
    assert why is not None and "cannot resume" in why
    assert unsupported(SamplingParams(max_tokens=8), already=3) is None  # unguided: resumes
    for odd in ("not json", "[]", '{"grammars": []}', '{"grammars": [{"lark_grammar": "x"}]}'):
        assert schema_of(odd) is None
        assert "no JSON schema" in (unsupported(SamplingParams(max_tokens=8, guide=odd)) or "")
