"""`tandem plan ...`: its subcommands (more come with the planner issue)."""

from __future__ import annotations

import argparse

from tandem.plan import profile


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="profile this machine (and, to come, plan a deployment)")
    plan_sub = p.add_subparsers(dest="plan_command", required=True, metavar="PLAN_COMMAND")
    profile.add_parser(plan_sub)
