"""The autoscaler's policy options, shared by `tandem autoscale` and `tandem up --autoscale`."""

from __future__ import annotations

import argparse

from shared.runtime.options import add_option
from tandem.autoscale.policy import Policy, PolicyConfig
from tandem.autoscale.types import RoleBounds


def add_policy_options(p: argparse.ArgumentParser) -> None:
    d = PolicyConfig()
    add_option(p, "--decode-min", type=int, default=1)
    add_option(p, "--decode-max", type=int, default=4)
    add_option(p, "--prefill-min", type=int, default=1)
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
    add_option(p, "--down-window", type=float, default=d.down_window)
    add_option(p, "--scale-cooldown", type=float, default=d.cooldown)


def policy_from_args(args: argparse.Namespace) -> Policy:
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
            down_window=args.down_window,
            cooldown=args.scale_cooldown,
            bounds={
                "decode": RoleBounds(args.decode_min, args.decode_max),
                "prefill": RoleBounds(args.prefill_min, args.prefill_max),
            },
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return Policy(config)
