"""`tandem up`: the whole stack on one machine (tandem/launcher.py), until Ctrl-C.

Returns control (prints the URL) once the router answers /readyz, reports loudly a child
that dies, and with `--autoscale` runs the autoscaler over the stack's own processes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from shared.procs import BACKGROUND_NICE, move_process
from shared.runtime.options import (
    add_chunking_options,
    add_model_options,
    add_nats_auth_options,
    add_option,
    niceness,
    target_seconds,
    thread_count,
)
from tandem.autoscale.options import add_policy_options
from tandem.launcher import Stack, exit_code, prefill_nodes, served_models
from tandem.mode import choose_mode, mode_problem


def add_up_options(p: argparse.ArgumentParser) -> None:
    add_option(
        p, "--prefill", type=int, default=None, help="prefill nodes (default 1; 0: colocated)"
    )
    add_option(
        p,
        "--colocated",
        action="store_true",
        help="force colocated serving: no prefill node, each decode node prefills its own "
        "requests (default: the mode the planner ranks best for this machine)",
    )
    add_option(
        p,
        "--split",
        action="store_true",
        help="force the fixed split: every prompt prefilled on the prefill nodes",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="force conditional disaggregation: the router prefills each request on its "
        "decode node or on the prefill nodes, whichever gives the first token sooner",
    )
    add_option(
        p,
        "--profile",
        default=None,
        help="this machine's costs (a tandem plan profile JSON) for the mode choice and "
        "--conditional (default: a startup profile measured once and cached)",
    )
    add_option(
        p,
        "--tpot-target",
        type=target_seconds,
        default=0.0,
        help="seconds a token the running streams keep within: --conditional (with --profile) "
        "prefills on a decode node only while they do (0: no target)",
    )
    add_option(p, "--pin-cores", action="store_true", help="pin each model node to its own core")
    add_option(
        p,
        "--isolate-decode",
        action="store_true",
        help="each decode node's engine thread on a core nothing else uses; every other "
        "process and thread on the remaining cores (needs more cores than decode nodes)",
    )
    add_option(
        p,
        "--background-nice",
        type=niceness,
        default=BACKGROUND_NICE,
        help="niceness of the prefill and kvcache nodes (0-19; 0: as the rest), so that where "
        "they share cores with decode nodes the decode steps, which every stream waits on, "
        "run first (docs/benchmarks-log.md)",
    )
    add_option(
        p,
        "--prefill-idle-threads",
        type=thread_count,
        default=None,
        help="torch threads of a prefill node for a batch the router sent while serving "
        "nothing else, so with every decode node idle (default: every core, unless "
        "--isolate-decode or --pin-cores keeps nodes apart; 0: never more than --threads)",
    )
    add_option(p, "--decode", type=int, default=1, help="decode nodes (of each model)")
    add_option(
        p,
        "--shared-decode",
        action="store_true",
        help="several models: each of the --decode nodes hosts every model, their KV memory "
        "one --kv-cache-mb budget (instead of --decode nodes per model)",
    )
    add_option(p, "--kvcache", type=int, default=1, help="KV-cache nodes")
    add_option(p, "--kvcache-mb", type=int, default=1024, help="memory per KV-cache node")
    add_option(p, "--host", default="127.0.0.1")
    add_option(p, "--port", type=int, default=8000)
    add_option(p, "--nats", default=None, help="use this NATS server instead of starting one")
    add_option(p, "--nats-port", type=int, default=None, help="port of the embedded nats-server")
    add_nats_auth_options(p)
    add_option(p, "--api-keys", default=None, help="comma-separated bearer keys for the API")
    add_option(p, "--api-keys-file", default=None, help="file of bearer keys, one per line")
    add_option(p, "--transport", default="ucx", choices=["ucx", "tcp"])
    add_option(p, "--kv-cache-mb", type=int, default=1024)
    add_chunking_options(p, deployment=True)  # the model nodes' (and the router's choice)
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    add_option(p, "--log-level", default="INFO")
    add_option(p, "--otlp-endpoint", default=None, help="export traces over OTLP (e.g. Jaeger)")
    add_option(
        p,
        "--autoscale",
        action="store_true",
        help="scale prefill and decode nodes with load (see the --decode-max ... options)",
    )
    add_model_options(p, several=True)  # each model gets --prefill and --decode nodes
    add_policy_options(p)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run the whole stack on this machine")
    add_up_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.decode < 1:
        print("error: --decode must be at least 1", file=sys.stderr)
        return 2
    if args.prefill is not None and (args.prefill < 0 or (args.colocated and args.prefill)):
        print("error: --prefill must be at least 0 (and 0 with --colocated)", file=sys.stderr)
        return 2
    if args.isolate_decode and (args.pin_cores or args.autoscale):
        print("error: --isolate-decode places every node itself: not with --pin-cores or "
              "--autoscale", file=sys.stderr)  # fmt: skip
        return 2
    served_models(args)  # a bad models file stops here, before anything starts
    problem = mode_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        print(choose_mode(args), flush=True)
    except (RuntimeError, ValueError) as exc:  # no profile, or one the stack cannot use
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stack = Stack(args)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        if not (args.api_keys or args.api_keys_file):
            stack.say(
                "[up] no API keys (TANDEM_API_KEYS or --api-keys-file): the API is open to "
                f"anyone who can reach {args.host}:{args.port}"
            )
        stack.start()
        if stack.shared_cpus:  # this process too: its threads relay every service's output
            move_process(0, stack.shared_cpus)
        stack.say(
            f"[up] starting {args.kvcache} kvcache, {prefill_nodes(args)} prefill and "
            f"{args.decode} decode node(s); "
            f"waiting for {stack.url}/readyz"
        )
        while not stopping.is_set():
            try:
                stack.wait_ready(timeout=1.0)
                break
            except RuntimeError as exc:
                if "exited" in str(exc):
                    raise
        if not stopping.is_set() and args.autoscale:
            from tandem.autoscale.local_backend import start_local

            start_local(stack, args, stopping)
            stack.say(
                f"[up] autoscaling: decode {args.decode_min}..{args.decode_max}, "
                f"prefill {args.prefill_min}..{args.prefill_max} nodes"
            )
        if not stopping.is_set():
            stack.say(
                f"[up] Tandem is ready: {stack.url}  (OpenAI API at {stack.url}/v1; Ctrl-C stops)"
            )
        while not stopping.is_set():
            for c in stack.dead_children():
                code = 1
                stack.say(f"[up] !!! {c.name} DIED with exit code {exit_code(c)} !!!")
            stopping.wait(0.5)
    except RuntimeError as exc:
        stack.say(f"[up] error: {exc}")
        code = 1
    finally:
        stack.say("[up] stopping all services")
        stack.stop()
        stack.say("[up] stopped")
    return code
