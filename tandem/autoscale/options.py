"""The autoscaler's policy options, shared by `tandem autoscale` and `tandem up --autoscale`
(policies.py builds the policy they ask for: this module stays light, since `tandem up`'s
options import it and the SLO policy imports the planner)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from shared.runtime.options import add_option, target_seconds
from tandem.autoscale.policy import PolicyConfig
from tandem.autoscale.types import SloConfig

POLICIES = ("threshold", "slo")


def add_policy_options(p: argparse.ArgumentParser, slo_targets: bool = True) -> None:
    d = PolicyConfig()
    add_option(p, "--decode-min", type=int, default=1)
    add_option(p, "--decode-max", type=int, default=4)
    add_option(
        p,
        "--prefill-min",
        type=int,
        default=1,
        help="0 (with a --conditional router only): the decode nodes prefill while no "
        "prefill node is up, and the SLO policy weighs running without the pool",
    )
    add_option(p, "--prefill-max", type=int, default=4)
    add_option(p, "--scale-interval", type=float, default=1.0, help="seconds between samples")
    add_option(
        p,
        "--decode-running-high",
        type=float,
        default=d.decode_running_high,
        help="running sequences per decode node that call for one more",
    )
    add_option(p, "--decode-running-low", type=float, default=d.decode_running_low)
    add_option(p, "--kv-used-high", type=float, default=d.kv_used_high)
    add_option(p, "--kv-used-low", type=float, default=d.kv_used_low)
    add_option(p, "--queue-high", type=float, default=d.queue_high, help="prefill jobs per node")
    add_option(p, "--ttft-high", type=float, default=d.ttft_high)
    add_option(p, "--ttft-low", type=float, default=d.ttft_low)
    add_option(p, "--up-window", type=float, default=d.up_window)
    add_option(
        p,
        "--down-window",
        type=float,
        default=None,
        help=f"seconds a smaller size must hold before a node goes (default: "
        f"{d.down_window:g} for --policy threshold, {SloConfig.down_window:g} for slo)",
    )
    add_option(p, "--scale-cooldown", type=float, default=d.cooldown)
    add_slo_options(p, slo_targets)


def add_metrics_options(p: argparse.ArgumentParser) -> None:
    """Where the autoscaler serves its own /metrics (metrics.py), if anywhere."""
    add_option(
        p,
        "--scale-metrics-port",
        type=int,
        default=None,
        help="serve the autoscaler's /metrics here (0: any port; default: none)",
    )
    add_option(
        p,
        "--scale-metrics-host",
        default="127.0.0.1",
        help="address the autoscaler's /metrics listens on (0.0.0.0 for a Prometheus elsewhere)",
    )


def add_slo_options(p: argparse.ArgumentParser, slo_targets: bool = True) -> None:
    """`--policy slo` and what it plans with (tandem/autoscale/slo.py); `slo_targets`
    False: not the policy choice, the targets and the profile (`tandem plan simulate`
    has its own)."""
    c = SloConfig()
    add_option(
        p,
        "--headroom",
        type=float,
        default=c.headroom,
        help="--policy slo: plan for the forecast load times 1 + this",
    )
    add_option(
        p,
        "--slo-window",
        type=float,
        default=c.window,
        help="--policy slo: seconds of arrivals the load is measured over",
    )
    add_option(
        p,
        "--slo-horizon",
        type=float,
        default=c.horizon,
        help="--policy slo: seconds ahead the load is forecast (about a node's start)",
    )
    add_option(
        p,
        "--slo-interval",
        type=float,
        default=c.interval,
        help="--policy slo: seconds a size is planned to hold: the trend is read and the "
        "load forecast this much further ahead, a role scales up again within it only when "
        "the load outruns the last plan, and scales down every spare node at once (fewer "
        "replica changes for more node-seconds; 0: down one node at a time)",
    )
    if not slo_targets:
        return
    add_option(
        p,
        "--policy",
        choices=POLICIES,
        default="threshold",
        help="threshold: the load thresholds above; slo: the planner sizes prefill and "
        "decode nodes for the observed load to meet --slo-ttft and --slo-tpot",
    )
    add_option(p, "--slo-ttft", type=target_seconds, default=0.0, help="--policy slo: seconds")
    add_option(
        p, "--slo-tpot", type=target_seconds, default=0.0, help="--policy slo: seconds a token"
    )
    add_option(
        p,
        "--slo-attainment",
        type=float,
        default=0.99,
        help="--policy slo: share of requests meeting both",
    )
    add_option(
        p,
        "--scale-profile",
        default=None,
        help="--policy slo: the profile the planner sizes with (tandem plan profile; "
        "tandem up: its --profile, else its startup profile)",
    )


def slo_problem(args: argparse.Namespace, need_profile: bool = True) -> str | None:
    """What `--policy slo` lacks, if anything (`need_profile`: its profile too; `tandem up`
    finds one itself)."""
    if getattr(args, "policy", "threshold") != "slo":
        return None
    if not args.slo_ttft or not args.slo_tpot:
        return "--policy slo needs --slo-ttft and --slo-tpot"
    if not 0 < args.slo_attainment <= 1:
        return f"--slo-attainment must be in (0, 1], got {args.slo_attainment}"
    if need_profile and not args.scale_profile:
        return "--policy slo needs a profile: --scale-profile FILE (tandem plan profile)"
    return None


def scaled_nodes_problem(args: argparse.Namespace) -> str | None:
    """What a real stack's bounds cannot do, if anything: no decode node serves nothing,
    and only a conditional router serves with no prefill node. (Said before the stack
    starts: the policy refuses it too, but `tandem up` builds it in a thread, where the
    error went unseen.)"""
    if args.decode_min < 1:
        return "--decode-min must be at least 1"
    return prefill_min_problem(args)


def prefill_min_problem(args: argparse.Namespace, node_options: Sequence[str] = ()) -> str | None:
    """`--prefill-min 0` without a conditional router (`args.conditional`, or `--conditional`
    among the nodes' simulate options), which alone serves with no prefill node."""
    conditional = getattr(args, "conditional", False) or "--conditional" in node_options
    if args.prefill_min < 1 and not conditional:
        return (
            "--prefill-min 0 needs a conditional router (--conditional), which prefills on "
            "decode nodes while no prefill node is up"
        )
    return None
