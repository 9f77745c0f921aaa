"""`tandem up`: the whole stack on one machine (tandem/launcher.py), until Ctrl-C.

Returns control (prints the URL) once the router answers /readyz, reports loudly a child
that dies, and with `--autoscale` runs the autoscaler over the stack's own processes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from shared.procs import move_process
from shared.runtime.options import open_api_problem
from tandem.autoscale.options import scaled_nodes_problem, slo_problem
from tandem.launcher import Stack, exit_code, prefill_nodes, served_models
from tandem.mode import choose_mode, mode_problem, prepare_slo_scaling
from tandem.up_options import add_up_options, keys_given


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
    problem = (
        open_api_problem(args.host, keys_given(args), args.allow_open)
        or mode_problem(args)
        or (slo_problem(args, need_profile=False) if args.autoscale else None)
        or (scaled_nodes_problem(args) if args.autoscale else None)
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        print(choose_mode(args), flush=True)
        if args.autoscale and args.policy == "slo":
            prepare_slo_scaling(args)
    except KeyboardInterrupt:  # Ctrl-C while the startup profile is measured: nothing ran
        print("[up] stopped before starting", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError) as exc:  # no profile, or one the stack cannot use
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stack = Stack(args)
    stopping = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        # Not stopping.set() here: a handler runs between two bytecodes of the main thread,
        # which may hold the Event's lock (in its own wait), or be in this handler's set()
        # when a second signal comes (Ctrl-C, then `timeout`'s TERM): set() would wait for
        # a lock its own thread holds, for ever. A thread of its own takes the lock in turn.
        if not stopping.is_set():
            threading.Thread(target=stopping.set, name="stop", daemon=True).start()

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
