"""A models file (shared/model/catalog.py): what it accepts, its clear errors, the nodes
`tandem up` plans from it (each model's dtype), and the router's per-model limits."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.router.main import config_of
from services.router.validation import Limits, parse_request
from shared.errors import InvalidRequestError
from shared.model.catalog import ModelEntry, ModelsFileError, read_models_file
from shared.model.tokenizer import load_tokenizer
from shared.runtime.options import model_entries
from tandem.cli import build_parser
from tandem.launcher import Stack

pytestmark = pytest.mark.unit

TWO = """
[[model]]
name = "smol"
source = "smollm2-135m-instruct"

[[model]]
name = "smol-bf16"
source = "smollm2-135m-instruct"
dtype = "bfloat16"
max_tokens_limit = 8
max_prompt_tokens = 20
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_a_file_of_two_models_reads_in_order(tmp_path: Path) -> None:
    smol, bf16 = read_models_file(write(tmp_path, TWO))
    assert smol == ModelEntry("smol", "smollm2-135m-instruct")
    assert bf16 == ModelEntry("smol-bf16", "smollm2-135m-instruct", "bfloat16", 8, 20)
    assert bf16.option == "smol-bf16=smollm2-135m-instruct"
    assert ModelEntry(None, "/models/x").option == "/models/x"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "no [[model]] entry"),
        ("[[model]]\nname = 'a'\nsource = 'b'\n[extra]\nx = 1\n", "unknown table"),
        ("[[model]\nname = 'a'", "not valid TOML"),
        ("[[model]]\nsource = 'b'\n", "'name' is required"),
        ("[[model]]\nname = 'a'\n", "'source' is required"),
        ("[[model]]\nname = 'a=b'\nsource = 'b'\n", "may not contain"),
        ("[[model]]\nname = 'a'\nsource = 'b'\ndtype = 'int8'\n", "'dtype' must be one of"),
        ("[[model]]\nname = 'a'\nsource = 'b'\nmax_tokens_limit = 0\n", "positive integer"),
        ("[[model]]\nname = 'a'\nsource = 'b'\nmax_prompt_tokens = true\n", "positive integer"),
        ("[[model]]\nname = 'a'\nsource = 'b'\ncolour = 'red'\n", "unknown key(s) ['colour']"),
        ("[[model]]\nname = 'a'\nsource = 'b'\n[[model]]\nname = 'a'\nsource = 'c'\n", "twice"),
    ],
)
def test_a_bad_file_is_one_clear_error(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ModelsFileError, match=None) as err:
        read_models_file(write(tmp_path, text))
    assert said in str(err.value)
    with pytest.raises(ModelsFileError, match="models file"):
        read_models_file(tmp_path / "missing.toml")


def test_models_come_from_the_file_or_the_flags_not_both(tmp_path: Path) -> None:
    path = str(write(tmp_path, TWO))
    args = argparse.Namespace(model=None, models_file=path)
    assert [m.name for m in model_entries(args, "default")] == ["smol", "smol-bf16"]
    args = argparse.Namespace(model=["a", "b=c"], models_file=None)
    assert [m.option for m in model_entries(args, "default")] == ["a", "b=c"]
    assert [m.option for m in model_entries(argparse.Namespace(model=None), "d")] == ["d"]
    with pytest.raises(SystemExit, match="not both"):
        model_entries(argparse.Namespace(model=["a"], models_file=path), "default")
    with pytest.raises(SystemExit, match="no \\[\\[model\\]\\] entry"):
        model_entries(argparse.Namespace(model=None, models_file=str(write(tmp_path, ""))), "d")


def test_up_plans_each_models_nodes_with_its_dtype(tmp_path: Path) -> None:
    path = str(write(tmp_path, TWO))
    args = build_parser().parse_args(["up", "--models-file", path, "--dtype", "float16"])
    children = {c.name: c.argv for c in Stack(args).plan()}

    def opt(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert [opt(children[n], "--model") for n in ("prefill-1", "prefill-2")] == [
        "smol=smollm2-135m-instruct",
        "smol-bf16=smollm2-135m-instruct",
    ]
    # the first has no dtype of its own: the command's; the second its own
    assert [opt(children[n], "--dtype") for n in ("decode-1", "decode-2")] == [
        "float16",
        "bfloat16",
    ]
    router = children["router"]
    assert opt(router, "--models-file") == path and "--model" not in router


def test_a_models_own_limits_hold_its_requests_alone(tmp_path: Path) -> None:
    models = read_models_file(write(tmp_path, TWO))
    args = build_parser().parse_args(["router", "--max-tokens-limit", "100"])
    limits = config_of(args, "r", models).limits
    assert limits.per_model == {"smol-bf16": (8, 20)}
    assert limits.for_model("smol") is limits
    own = limits.for_model("smol-bf16")
    assert (own.max_tokens, own.max_prompt_tokens, own.max_stop) == (8, 20, Limits().max_stop)
    tok = load_tokenizer("smollm2-135m-instruct")
    served = {"smol": tok, "smol-bf16": tok}
    body = {"prompt": "Hello there", "max_tokens": 50}
    assert parse_request({**body, "model": "smol"}, False, served, limits).params.max_tokens == 50
    with pytest.raises(InvalidRequestError) as err:
        parse_request({**body, "model": "smol-bf16"}, False, served, limits)
    assert err.value.param == "max_tokens"
    long_prompt = {"prompt": " word" * 30, "max_tokens": 4}
    parse_request({**long_prompt, "model": "smol"}, False, served, limits)
    with pytest.raises(InvalidRequestError, match="at most 20"):
        parse_request({**long_prompt, "model": "smol-bf16"}, False, served, limits)


def test_shared_decode_plans_decode_processes_hosting_every_model(tmp_path: Path) -> None:
    """`--shared-decode`: --decode processes in all, each given every model (the models
    file, which carries each model's dtype, or every --model); prefill nodes stay per
    model. The decode command reads the same models, a node per model in one process."""
    path = str(write(tmp_path, TWO))
    args = build_parser().parse_args(
        ["up", "--models-file", path, "--decode", "2", "--shared-decode"]
    )
    children = {c.name: c.argv for c in Stack(args).plan()}
    assert sorted(n for n in children if n.startswith("decode")) == ["decode-1", "decode-2"]
    for name in ("decode-1", "decode-2"):
        argv = children[name]
        assert argv[argv.index("--models-file") + 1] == path and "--model" not in argv
    assert sorted(n for n in children if n.startswith("prefill")) == ["prefill-1", "prefill-2"]
    args = build_parser().parse_args(["up", "--model", "a", "--model", "b=c", "--shared-decode"])
    decode = next(c.argv for c in Stack(args).plan() if c.name == "decode-1")
    assert [decode[i + 1] for i, x in enumerate(decode) if x == "--model"] == ["a", "b=c"]
    decode_args = build_parser().parse_args(decode)
    assert [m.option for m in model_entries(decode_args, "d")] == ["a", "b=c"]
