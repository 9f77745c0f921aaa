"""--nats-password-file / TANDEM_NATS_PASSWORD_FILE: a service reads its NATS password from a
file (compose mounts each role's from a volume of its own). A bad file stops the command with
its reason and no traceback; which source wins when several are given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.bus.auth import EXAMPLE_PASSWORD, BusAuth
from shared.errors import TandemError
from tandem.cli import build_parser

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# Every command that connects to NATS takes the options (add_nats_auth_options).
COMMANDS = [["router"], ["prefill"], ["decode"], ["kvcache"], ["autoscale"], ["purge-kv"]]


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "nats-password"
    path.write_text("p-from-the-file\n")  # as `echo` or a generator writes it: a line end
    return path


def password(argv: list[str]) -> str | None:
    value: str | None = build_parser().parse_args(argv).nats_password
    return value


def test_every_nats_command_reads_the_file_its_variable_names(
    secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(secret))
    for argv in COMMANDS:
        if argv == ["purge-kv"]:
            argv = ["purge-kv", "--producer", "decode-1"]
        assert password(argv) == "p-from-the-file", argv


def test_the_flag_reads_the_file(secret: Path) -> None:
    assert password(["kvcache", "--nats-password-file", str(secret)]) == "p-from-the-file"
    assert password(["kvcache"]) is None


def test_the_password_connects_as_the_roles_identity(
    secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_NATS_USER", "kvcache")
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(secret))
    kwargs = BusAuth.from_args(build_parser().parse_args(["kvcache"])).connect_kwargs()
    assert (kwargs["user"], kwargs["password"]) == ("kvcache", "p-from-the-file")


def test_the_example_password_is_refused_from_a_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = tmp_path / "example"
    example.write_text(EXAMPLE_PASSWORD + "\n")
    monkeypatch.setenv("TANDEM_NATS_USER", "kvcache")
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(example))
    with pytest.raises(TandemError, match="NATS_PASSWORD"):
        BusAuth.from_args(build_parser().parse_args(["kvcache"])).connect_kwargs()


def test_precedence(secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag wins over both variables; TANDEM_NATS_PASSWORD over TANDEM_NATS_PASSWORD_FILE,
    whose file is then not even read (`tandem up` hands its services the former while they
    inherit the caller's variables)."""
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(tmp_path / "gone"))
    monkeypatch.setenv("TANDEM_NATS_PASSWORD", "p-from-the-variable")
    assert password(["kvcache"]) == "p-from-the-variable"
    assert password(["kvcache", "--nats-password-file", str(secret)]) == "p-from-the-file"
    monkeypatch.delenv("TANDEM_NATS_PASSWORD")
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(secret))
    assert password(["kvcache", "--nats-password", "p-from-the-flag"]) == "p-from-the-flag"


def test_both_flags_at_once_are_an_error(secret: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        password(["kvcache", "--nats-password", "p-x", "--nats-password-file", str(secret)])
    assert "not allowed with argument --nats-password" in capsys.readouterr().err


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of bad file, with what the error says about it."""
    empty, blank, two, binary = (tmp_path / n for n in ("empty", "blank", "two", "binary"))
    empty.write_text("")
    blank.write_text(" \n\n")
    two.write_text("p-one\np-two\n")
    binary.write_bytes(b"\xff\xfe\x00")
    return {
        "missing": (tmp_path / "missing", "no such file"),
        "a directory": (tmp_path, "cannot read"),
        "empty": (empty, "is empty"),
        "blank": (blank, "is empty"),
        "two lines": (two, "more than one line"),
        "not text": (binary, "not UTF-8 text"),
    }


@pytest.mark.parametrize(
    "kind", ["missing", "a directory", "empty", "blank", "two lines", "not text"]
)
def test_a_bad_file_is_a_clear_error(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, says = bad_files(tmp_path)[kind]
    # From the variable: the command stops while its parser is built.
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(path))
    with pytest.raises(SystemExit) as exc:
        build_parser()
    assert str(exc.value).startswith(f"error: TANDEM_NATS_PASSWORD_FILE={str(path)!r}: ")
    assert says in str(exc.value) and str(path) in str(exc.value)
    monkeypatch.delenv("TANDEM_NATS_PASSWORD_FILE")
    # From the flag: argparse's usage error (exit status 2).
    with pytest.raises(SystemExit) as exc:
        password(["kvcache", "--nats-password-file", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --nats-password-file:" in err and says in err


def test_no_traceback_from_the_command(tmp_path: Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "TANDEM_NATS_PASSWORD_FILE": str(tmp_path / "missing"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "kvcache", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"error: TANDEM_NATS_PASSWORD_FILE={str(tmp_path / 'missing')!r}: "
        f"no such file {tmp_path / 'missing'}"
    )
