"""`tandem up`'s serving mode: forced by a flag, or the planner's pick (tandem/plan/pick.py).

`choose_mode` settles the mode before anything starts and sets `args` to run it
(`colocated`, `conditional` with a profile, or neither for the split); it returns the one
line `tandem up` prints about it. The planner picks only where its model covers the
stack: one model, no shared decode processes, no autoscaler (which scales a split's
pools); elsewhere the split stays the default, and the line says why.
"""

from __future__ import annotations

import argparse

from tandem.launcher import Stack, prefill_nodes, served_models
from tandem.plan.pick import Setting, choose, ensure_profile

FLAGS = ("colocated", "split", "conditional")


def mode_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the mode flags, if anything."""
    given = [f"--{f}" for f in FLAGS if getattr(args, f)]
    if len(given) > 1:
        return f"{' and '.join(given)} each force a mode: give one"
    if args.prefill == 0 and (args.split or args.conditional):
        return f"{given[0]} needs prefill nodes: not with --prefill 0"
    if getattr(args, "engine", "native") == "vllm":
        return vllm_problem(args)
    return None


def vllm_problem(args: argparse.Namespace) -> str | None:
    """What `--engine vllm` cannot serve yet: prefill nodes (no KV hand-off into vLLM's
    engine without its KV connector) and several models in one process (docs/engines.md)."""
    if args.split or args.conditional or args.prefill:
        return "--engine vllm serves colocated only for now: not with prefill nodes"
    if args.shared_decode and not _single_model(args):
        return "--engine vllm runs one model a process: not with --shared-decode"
    return None


def choose_mode(args: argparse.Namespace) -> str:
    """Settle the mode (setting `args`) and say which it is and why, in one line."""
    if getattr(args, "engine", "native") == "vllm":
        # the launcher starts no prefill node for vLLM's engine (launcher.prefill_nodes)
        return "[up] mode: colocated (--engine vllm serves colocated only for now)"
    forced = (
        "colocated" if args.prefill == 0 else next((f for f in FLAGS if getattr(args, f)), None)
    )
    if forced is not None:
        if forced == "conditional" and not args.profile and _single_model(args):
            args.profile = str(ensure_profile(_setting(args), _say))
        flag = "--prefill 0" if args.prefill == 0 and not args.colocated else f"--{forced}"
        return f"[up] mode: {forced} (forced by {flag})"
    why_not = _not_planned(args)
    if why_not:
        return f"[up] mode: split ({why_not}; --colocated or --conditional force another)"
    profile = args.profile or str(ensure_profile(_setting(args), _say))
    choice = choose(profile, prefill_nodes(args), args.decode, _node_options(args))
    if choice.mode == "colocated":
        args.decode += prefill_nodes(args)  # the same cores, every node prefilling its own
        args.prefill, args.colocated = 0, True
    elif choice.mode == "conditional":
        args.conditional, args.profile = True, profile
    return (
        f"[up] mode: {choice.mode}, the planner's pick ({choice.reason()}); "
        "--colocated, --split or --conditional force one"
    )


def _not_planned(args: argparse.Namespace) -> str | None:
    if not _single_model(args):
        return "the planner's pick covers one model"
    if args.shared_decode:
        return "shared decode"
    if args.autoscale:
        return "the autoscaler scales a split's pools"
    return None


def _single_model(args: argparse.Namespace) -> bool:
    return len(served_models(args)) == 1


def _setting(args: argparse.Namespace) -> Setting:
    """The profile a node of this stack needs: its model, dtype and device, the torch
    threads the launcher gives a decode node (read from its plan of a stack it never
    starts: one rule for both), and the stack's data plane."""
    (model,) = served_models(args)
    decode = next(c for c in Stack(args).plan() if c.name.startswith("decode"))
    threads = int(decode.argv[decode.argv.index("--threads") + 1])
    return Setting(model.source, model.dtype or args.dtype, args.device, threads, args.transport)


def prepare_slo_scaling(args: argparse.Namespace) -> None:
    """`tandem up --autoscale --policy slo`: the profile the planner sizes with (the one
    given, else the stack's --profile, else this machine's startup profile) and what the
    nodes run with, on `args` for the autoscaler."""
    if not args.scale_profile:
        args.scale_profile = args.profile or str(ensure_profile(_setting(args), _say))
    args.scale_node_options = _node_options(args) + (["--conditional"] if args.conditional else [])


def _node_options(args: argparse.Namespace) -> list[str]:
    """`tandem plan simulate` options for what the stack's nodes will run with."""
    out = [
        "--transport", args.transport,
        "--kvcache", str(args.kvcache),
        "--kv-cache-mb", str(args.kv_cache_mb),
        "--prefill-chunk-tokens", str(args.prefill_chunk_tokens),
    ]  # fmt: skip
    if args.step_token_budget is not None:
        out += ["--step-token-budget", str(args.step_token_budget)]
    if args.tpot_target:
        out += ["--tpot-target", f"{args.tpot_target:g}"]
    if args.no_prefill_bursts:
        out.append("--no-prefill-bursts")
    return out


def _say(line: str) -> None:
    print(line, flush=True)
