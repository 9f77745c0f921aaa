"""tandem/plan/compiled.py without building: which build belongs to which sources, and
when the compiled modules may be loaded."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

import tandem.plan.simulator  # noqa: F401  (imported: the sources now serve this process)
from tandem.plan import compiled


def test_a_build_belongs_to_the_sources_it_was_made_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in compiled.MODULES:
        copy = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(compiled.source(module), copy)
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    before = compiled.key()
    assert compiled.key() == before  # a function of the sources alone
    assert compiled.built() is None  # nothing built in this cache
    where = compiled.build_dir()
    for module in compiled.MODULES:  # a build's files, as `build` leaves them
        *package, name = module.split(".")
        library = where.joinpath(*package) / f"{name}{compiled.EXT}"
        library.parent.mkdir(parents=True, exist_ok=True)
        library.write_bytes(b"")
    assert compiled.built() is None  # not marked complete: a build in progress or failed
    (where / "complete").write_text(before)
    built = compiled.built()
    assert built is not None and set(compiled.MODULES) <= set(built)
    scheduler = tmp_path / "shared" / "engine" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n# edited\n")
    assert compiled.key() != before  # an edited source: that build is not its build
    assert compiled.built() is None


def test_compiled_modules_are_never_mixed_with_their_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This process imported the simulator's sources: loading compiled copies now would
    # make two classes of each; activate refuses, built or not.
    monkeypatch.setattr(
        compiled, "built", lambda: {m: Path("/nonexistent") for m in compiled.MODULES}
    )
    assert compiled.activate() is False
    assert compiled.activate_for(["plan", "simulate"]) is False
    assert not compiled.active()


def test_only_the_commands_that_only_simulate_load_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(compiled, "activate", lambda: calls.append(True) or True)
    assert compiled.activate_for(["plan", "simulate", "--profile", "p.json"])
    assert compiled.activate_for(["plan", "search"])
    assert not compiled.activate_for(["plan", "validate"])  # it runs a real stack too
    assert not compiled.activate_for(["router"]) and not compiled.activate_for([])
    assert len(calls) == 2


def test_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.ENV_SWITCH, "off")
    assert not compiled.wanted() and compiled.activate() is False
    monkeypatch.setenv(compiled.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="TANDEM_SIM_COMPILED"):
        compiled.wanted()


def test_compile_check_says_whether_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    compiled.add_parser(parser.add_subparsers())
    args = parser.parse_args(["compile", "--check"])
    assert args.func(args) == 1
    assert "not compiled" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # a check builds nothing
