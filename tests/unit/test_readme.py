"""The README's claims against the code: every `tandem` command it shows parses, every
option it names exists, every `make` target and variable is the Makefile's, every linked
file is there. A README that drifts from the code fails here."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cli import build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def commands() -> Iterator[str]:
    """`tandem ...` command lines: in code blocks (continuations joined) and inline code."""
    text = README.replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("tandem ", ".venv/bin/tandem ")):
            yield line.split("#", 1)[0]
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())  # a span may wrap
        if span.startswith("tandem ") and "|" not in span and "..." not in span:
            yield span


def subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from subparsers(sub)


def every_option() -> set[str]:
    return {
        flag
        for p in subparsers(build_parser())
        for action in p._actions
        for flag in action.option_strings
    }


def test_the_readme_shows_tandem_commands() -> None:
    assert len(list(commands())) >= 5


@pytest.mark.parametrize("line", sorted(set(commands())))
def test_each_tandem_command_parses(line: str) -> None:
    argv = shlex.split(line)[1:]
    if not any(a.startswith("-") for a in argv):  # a command named in prose: it exists
        argv.append("--help")
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing (0: it printed the help)
        if exc.code != 0:
            pytest.fail(f"`{line}` does not parse (exit {exc.code})")


def test_each_option_it_names_exists() -> None:
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", README))
    others = {"--help"}  # argparse's own
    missing = sorted(named - every_option() - others)
    # other tools' options in the examples (docker compose's) are not Tandem's
    assert [m for m in missing if m not in ("--build",)] == []


def test_make_targets_and_variables_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"(?:^|`)make (\w+)", README, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), target
    for variable in ("PYTHON", "TORCH"):
        assert f"{variable} ?=" in makefile


def test_linked_files_exist() -> None:
    for link in re.findall(r"\]\(([^)#]+)", README):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_it_stays_a_guide() -> None:
    assert len(README.splitlines()) <= 180
