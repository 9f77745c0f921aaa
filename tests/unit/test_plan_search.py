"""`tandem plan search`: the candidates, the binding SLO, and a recommendation that follows
from the simulated load (synthetic profile: a prefill of 1 ms a token, decode steps of
50 ms)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from tandem.plan import search
from tests.unit.test_plan_simulate import profile


def test_candidates_within_the_budget() -> None:
    names = [c.name for c in search.candidates(3)]
    assert names == ["colocated x1", "colocated x2", "1P:1D", "colocated x3", "1P:2D", "2P:1D"]


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict, str]:  # type: ignore[type-arg]
    prof = tmp_path / "p.json"
    prof.write_bytes(msgspec.json.encode(profile()))
    out = tmp_path / "search.json"
    parser = argparse.ArgumentParser()
    search.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["search", "--profile", str(prof), "--output", str(out), "--quiet", *argv]
    )
    code = search.run(args)
    return code, json.loads(out.read_text()), str(out)


def test_a_light_load_needs_one_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(
        tmp_path, "--max-nodes", "2", "--request-rate", "0.2", "--num-requests", "40",
        "--prompt-len", "200", "--output-len", "16", "--slo-ttft", "1", "--slo-tpot", "0.1",
    )  # fmt: skip
    assert code == 0
    assert doc["recommendation"]["deployment"] == "colocated x1"
    printed = capsys.readouterr().out
    assert "tandem up --colocated --decode 1" in printed
    assert "PREFILL_REPLICAS=0 DECODE_REPLICAS=1 TANDEM_COLOCATED=1" in printed
    assert len(doc["candidates"]) == 3 and doc["sweep_rates"] == pytest.approx(
        [0.2 * f for f in search.SWEEP_FACTORS]
    )


def test_a_load_beyond_one_node_gets_more_and_the_binding_slo_is_named(tmp_path: Path) -> None:
    """1,000-token prompts at 1.5 req/s: 1.5 s of prefill a second, more than one node's
    time; TTFT is what one node misses."""
    code, doc, _ = _run(
        tmp_path, "--max-nodes", "3", "--request-rate", "1.5", "--num-requests", "60",
        "--prompt-len", "1000", "--output-len", "4", "--slo-ttft", "3", "--slo-tpot", "0.5",
        "--arrival", "constant",
    )  # fmt: skip
    assert code == 0
    by_name = {c["deployment"]: c for c in doc["candidates"]}
    assert (
        by_name["colocated x1"]["attainment"] < 0.9 and by_name["colocated x1"]["binds"] == "TTFT"
    )
    rec = doc["recommendation"]["deployment"]
    assert by_name[rec]["nodes"] == 2 and by_name[rec]["attainment"] >= 0.9
    good = [c["goodput"] or 0 for c in doc["candidates"]]
    assert max(good) > (by_name["colocated x1"]["goodput"] or 0)


def test_nothing_meets_an_impossible_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc, _ = _run(
        tmp_path, "--max-nodes", "1", "--request-rate", "0.1", "--num-requests", "5",
        "--prompt-len", "500", "--output-len", "4", "--slo-ttft", "0.1",
    )  # fmt: skip
    assert code == 1 and doc["recommendation"] is None
    assert "no deployment of at most 1 nodes" in capsys.readouterr().out


def test_search_needs_a_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError):
        _run(tmp_path, "--request-rate", "inf")
    assert "needs a request rate" in capsys.readouterr().err


def test_each_candidate_gets_tandem_ups_step_budget_unless_one_is_given(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    prof.write_bytes(msgspec.json.encode(profile()))
    parser = argparse.ArgumentParser()
    search.add_parser(parser.add_subparsers())
    colocated, split = search.Candidate(colocated=2), search.Candidate(prefill=1, decode=1)
    for given, budgets in ([], (256, 64)), (["--step-token-budget", "128"], (128, 128)):
        args = parser.parse_args(["search", "--profile", str(prof), "--request-rate", "1", *given])
        planner = search.Planner.of(args, 1.0)
        got = [planner.topology(c).decode_engine.step_token_budget for c in (colocated, split)]
        assert tuple(got) == budgets
        assert planner.topology(split).prefill_engine.step_token_budget == 0  # whole batches
    assert "TANDEM_STEP_TOKEN_BUDGET=256" in colocated.compose_env({})


def test_a_conditional_recommendation_carries_the_routers_costs_and_target(tmp_path: Path) -> None:
    """The router must route as the simulation did: its profile's costs and TPOT target."""
    prof = tmp_path / "p.json"
    prof.write_bytes(msgspec.json.encode(profile()))
    parser = argparse.ArgumentParser()
    search.add_parser(parser.add_subparsers())
    split = search.Candidate(prefill=1, decode=2)
    base = ["search", "--profile", str(prof), "--request-rate", "1"]
    args = parser.parse_args([*base, "--conditional", "--tpot-target", "0.25"])
    router = search.router_settings(args)
    assert split.up_flags(router) == (
        f"tandem up --prefill 1 --decode 2 --conditional --profile {prof} --tpot-target 0.25"
    )
    assert split.compose_env(router) == (
        f"PREFILL_REPLICAS=1 DECODE_REPLICAS=2 TANDEM_CONDITIONAL=1 TANDEM_PROFILE={prof}"
        " TANDEM_TPOT_TARGET=0.25"
    )
    assert search.router_settings(parser.parse_args(base)) == {}
    assert split.up_flags({}) == "tandem up --prefill 1 --decode 2"
