"""`tandem up`'s serving mode: flags that force one, and the planner's pick from a profile
(tandem/mode.py, tandem/plan/pick.py). The startup profile's measurement and cache run for
real in tests/e2e/test_up.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from shared.costs.profile import TransferPoint
from tandem.cli import build_parser
from tandem.mode import choose_mode, mode_problem
from tandem.plan import pick
from tandem.plan.pick import MODES, Setting, best, choose
from tandem.up import run
from tests.unit.test_plan_simulate import profile

pytestmark = pytest.mark.unit


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def write_profile(path: Path, link: float | None = None) -> str:
    prof = profile(decode_grows=True)
    if link is not None:  # every byte over the data plane at `link` bytes/s
        prof = msgspec.structs.replace(
            prof,
            transfer=[
                TransferPoint(transport=t, bytes=n, seconds=n / link)
                for t in ("tcp", "ucx")
                for n in (1, 1 << 30)
            ],
        )
    path.write_bytes(msgspec.json.encode(prof))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--colocated", "--split"], "--colocated and --split each force a mode"),
        (["--split", "--conditional"], "--split and --conditional each force a mode"),
        (["--prefill", "0", "--split"], "--split needs prefill nodes"),
        (["--prefill", "0", "--conditional"], "--conditional needs prefill nodes"),
    ],
)
def test_conflicting_mode_flags_are_refused(argv: list[str], problem: str) -> None:
    assert problem in (mode_problem(up_args(*argv)) or "")


def test_each_flag_forces_its_mode_without_the_planner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_profile(*_: object) -> Path:
        raise AssertionError("a forced mode measures nothing")

    monkeypatch.setattr("tandem.mode.ensure_profile", no_profile)
    args = up_args("--colocated")
    assert choose_mode(args) == "[up] mode: colocated (forced by --colocated)"
    assert args.colocated and not args.conditional
    args = up_args("--prefill", "0")
    assert choose_mode(args) == "[up] mode: colocated (forced by --prefill 0)"
    args = up_args("--split")
    assert choose_mode(args) == "[up] mode: split (forced by --split)"
    assert not args.colocated and not args.conditional and args.profile is None
    prof = write_profile(tmp_path / "p.json")
    args = up_args("--conditional", "--profile", prof)
    assert choose_mode(args) == "[up] mode: conditional (forced by --conditional)"
    assert args.conditional and args.profile == prof


def test_the_default_runs_the_planners_pick_on_the_nodes_asked(tmp_path: Path) -> None:
    prof = write_profile(tmp_path / "p.json")
    args = up_args("--profile", prof, "--prefill", "1", "--decode", "2", "--transport", "tcp")
    line = choose_mode(args)
    want = choose(prof, 1, 2, ["--transport", "tcp", "--kvcache", "1"])
    assert line.startswith(f"[up] mode: {want.mode}, the planner's pick (simulated")
    assert "--colocated, --split or --conditional force one" in line
    if want.mode == "colocated":  # the same three nodes, each prefilling its own
        assert args.colocated and args.decode == 3 and args.prefill == 0
    else:
        assert args.decode == 2 and args.conditional == (want.mode == "conditional")


def test_a_profile_without_the_stacks_data_plane_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile(tmp_path / "p.json")  # tcp transfers only
    assert run(up_args("--profile", prof, "--transport", "ucx")) == 1
    assert "the profile has no 'ucx' transfers" in capsys.readouterr().err


def test_the_pick_follows_the_simulated_costs(tmp_path: Path) -> None:
    """With a data plane of 1 kB/s every hand-off takes minutes: a fixed split meets no
    SLO on the mixed workload, and is not picked; with a fast one, the figures decide."""
    slow = choose(write_profile(tmp_path / "slow.json", link=1e3), 1, 1, [])
    assert slow.mixed_goodput["split"] == 0.0 < slow.mixed_goodput["colocated"]
    assert slow.mode != "split"
    fast = choose(write_profile(tmp_path / "fast.json"), 1, 1, [])
    assert fast.mixed_goodput["split"] > 0.0
    for choice in (slow, fast):
        assert set(choice.scores) == set(MODES)
        assert max(choice.scores.values()) <= 1.0
        assert choice.mode == best(choice.scores)
        assert choice.reason().startswith("simulated from this machine's profile")


def test_near_ties_go_to_the_simpler_mode() -> None:
    assert best({"colocated": 0.99, "conditional": 1.0, "split": 0.5}) == "colocated"
    assert best({"colocated": 0.9, "conditional": 0.995, "split": 1.0}) == "conditional"
    assert best({"colocated": 0.5, "conditional": 0.9, "split": 1.0}) == "split"


def test_several_models_or_an_autoscaler_keep_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.mode.ensure_profile", lambda *_: pytest.fail("measured"))
    args = up_args("--model", "a", "--model", "b=c")
    assert choose_mode(args).startswith("[up] mode: split (the planner's pick covers one model")
    args = up_args("--autoscale")
    assert choose_mode(args).startswith("[up] mode: split (the autoscaler scales")
    assert not args.colocated and not args.conditional


def test_the_profile_cache_is_one_file_per_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    a = Setting("smollm2-135m-instruct", "float32", "auto", 1, "tcp")
    assert a.cached_profile() == Setting(*vars(a).values()).cached_profile()
    others = [
        Setting("other", "float32", "auto", 1, "tcp"),
        Setting("smollm2-135m-instruct", "bfloat16", "auto", 1, "tcp"),
        Setting("smollm2-135m-instruct", "float32", "auto", 2, "tcp"),
        Setting("smollm2-135m-instruct", "float32", "auto", 1, "ucx"),
    ]
    paths = {s.cached_profile() for s in [a, *others]}
    assert len(paths) == 5 and all(p.parent == tmp_path / "profiles" for p in paths)
    # a readable cached profile is used as it is; an unreadable one is measured again
    a.cached_profile().parent.mkdir(parents=True)
    write_profile(a.cached_profile())
    monkeypatch.setattr(pick.subprocess, "run", lambda *a, **k: pytest.fail("measured"))
    assert pick.ensure_profile(a, print) == a.cached_profile()
    a.cached_profile().write_text("{not json")
    with pytest.raises(pytest.fail.Exception, match="measured"):
        pick.ensure_profile(a, print)
    assert not a.cached_profile().exists()
