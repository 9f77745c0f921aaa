"""`tandem plan ...`: measure a machine, simulate a deployment, project to other hardware."""

from __future__ import annotations

import argparse

from tandem.plan import autoscale_sim, compiled, profile, project, search, simulate, validate


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="profile this machine, simulate and plan a deployment")
    plan_sub = p.add_subparsers(dest="plan_command", required=True, metavar="PLAN_COMMAND")
    profile.add_parser(plan_sub)
    autoscale_sim.add_options(simulate.add_parser(plan_sub))  # and its own run
    validate.add_parser(plan_sub)
    search.add_parser(plan_sub)
    project.add_parser(plan_sub)
    compiled.add_parser(plan_sub)
