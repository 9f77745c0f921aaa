"""The policy the autoscaler's options ask for: the threshold policy (policy.py) or the
SLO policy (slo.py, over the planner's simulator)."""

from __future__ import annotations

import argparse

from tandem.autoscale.options import prefill_min_problem, slo_problem
from tandem.autoscale.policy import Policy, PolicyConfig
from tandem.autoscale.sizer import Sizer
from tandem.autoscale.slo import SloPolicy
from tandem.autoscale.types import RoleBounds, Slo, SloConfig


def policy_from_args(
    args: argparse.Namespace, node_options: list[str] | None = None
) -> Policy | SloPolicy:
    """The policy the options ask for (`node_options`: `tandem plan simulate` options for
    what the nodes run with, for the SLO policy's planner)."""
    bounds = {
        "decode": RoleBounds(args.decode_min, args.decode_max),
        "prefill": RoleBounds(args.prefill_min, args.prefill_max),
    }
    if problem := prefill_min_problem(args, node_options or []):
        raise SystemExit(f"error: {problem}")
    if getattr(args, "policy", "threshold") == "slo":
        problem = slo_problem(args)
        if problem:
            raise SystemExit(f"error: {problem}")
        try:
            slo_config = SloConfig(
                window=args.slo_window,
                min_span=min(SloConfig.min_span, args.slo_window),
                horizon=args.slo_horizon,
                interval=args.slo_interval,
                headroom=args.headroom,
                up_window=args.up_window,
                down_window=_given(args.down_window, SloConfig.down_window),
                bounds=bounds,
            )
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from exc
        slo = Slo(args.slo_ttft, args.slo_tpot, args.slo_attainment)
        sizer = Sizer(args.scale_profile, slo, bounds, node_options or [])
        return SloPolicy(sizer, slo_config)
    try:
        config = PolicyConfig(
            decode_running_high=args.decode_running_high,
            decode_running_low=args.decode_running_low,
            kv_used_high=args.kv_used_high,
            kv_used_low=args.kv_used_low,
            queue_high=args.queue_high,
            ttft_high=args.ttft_high,
            ttft_low=args.ttft_low,
            up_window=args.up_window,
            down_window=_given(args.down_window, PolicyConfig.down_window),
            cooldown=args.scale_cooldown,
            bounds=bounds,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return Policy(config)


def _given(value: float | None, default: float) -> float:
    """An option left unset takes each policy's own default."""
    return default if value is None else value
