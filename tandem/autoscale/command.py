"""`tandem autoscale`: the autoscaler over a Docker Compose project or a Kubernetes namespace.

    tandem autoscale --nats nats://HOST:4222 --router-url http://HOST:8000 \\
        --project tandem --decode-max 4 --prefill-max 2
    tandem autoscale --backend kubernetes --namespace tandem ...
    tandem autoscale --pool smollm2-135m-instruct=prefill:decode \
        --pool smol-bf16=prefill-second:decode-second ...

reads the cluster from NATS (credentials as for every service: TANDEM_NATS_USER/PASSWORD)
and scales `prefill` and `decode`: the compose services through the Docker SDK, or the
Deployments through the Kubernetes API (in a pod, with its service account:
deploy/kubernetes/base/autoscaler.yaml). With `tandem up --autoscale` the same controller scales the
local stack's processes instead.

With `--pool MODEL=PREFILL:DECODE` (repeated, one per model) it scales each model's pool
on its own, as `tandem up --autoscale` does for a models file: the compose services or
Deployments PREFILL and DECODE hold that model's nodes (compose.second-model.yaml's
`prefill-second`/`decode-second`, for example), and each pool gets its own policy over
its own model's nodes, prefill queue and TTFT. Pools that all name one decode service
(`--pool A=prefill:decode --pool B=prefill-second:decode`, compose.shared-decode.yaml)
share its processes, each hosting every model: each model's policy then scales its
prefill service, and one more scales the decode service, a process counting once.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from shared.bus.auth import BusAuth
from shared.runtime.node import setup_logging, stop_on_signals
from shared.runtime.options import add_nats_auth_options, add_option
from shared.runtime.service import run_service
from tandem.autoscale.controller import run_controller
from tandem.autoscale.options import (
    add_metrics_options,
    add_policy_options,
    scaled_nodes_problem,
    slo_problem,
)
from tandem.autoscale.types import ROLES, Backend

log = logging.getLogger("tandem.autoscale")


def parse_pools(given: list[str] | None) -> dict[str, dict[str, str]]:
    """`--pool MODEL=PREFILL:DECODE` values: each model's role → compose service or
    Deployment name. A malformed or repeated one is an error naming it."""
    pools: dict[str, dict[str, str]] = {}
    for raw in given or []:
        model, sep, names = raw.partition("=")
        prefill, colon, decode = names.partition(":")
        model, prefill, decode = model.strip(), prefill.strip(), decode.strip()
        if not (sep and colon and model and prefill and decode) or ":" in decode:
            raise SystemExit(f"error: --pool {raw!r}: expected MODEL=PREFILL:DECODE")
        if model in pools:
            raise SystemExit(f"error: --pool names model {model!r} twice")
        pools[model] = dict(zip(ROLES, (prefill, decode), strict=True))
    return pools


def shared_decode_service(pools: dict[str, dict[str, str]]) -> str | None:
    """The decode service every pool names, when they name one (decode processes hosting
    every model, compose.shared-decode.yaml); None when each model has its own. Pools
    sharing a decode service with some models and not others are an error."""
    decodes = {names["decode"] for names in pools.values()}
    if len(pools) < 2 or len(decodes) == len(pools):
        return None
    if len(decodes) > 1:
        raise SystemExit("error: --pool: a decode service is shared by some models only")
    return decodes.pop()


async def serve(args: argparse.Namespace) -> None:
    setup_logging("autoscale", "autoscaler", args.log_level)
    if problem := slo_problem(args) or scaled_nodes_problem(args):
        raise SystemExit(f"error: {problem}")
    if args.conditional:  # what the SLO policy's planner simulates the nodes with
        args.scale_node_options = ["--conditional"]
    stop = stop_on_signals()
    pools = parse_pools(args.pool)
    make: Callable[[dict[str, str] | None], Backend]
    if args.backend == "kubernetes":
        from tandem.autoscale.kubernetes_backend import KubernetesBackend

        def make(names: dict[str, str] | None) -> Backend:
            return KubernetesBackend.from_environment(args.namespace, args.kubeconfig, names)

        where = f"Deployments in namespace {args.namespace or 'of the pod'}"
    else:
        from tandem.autoscale.docker_backend import DockerBackend

        def make(names: dict[str, str] | None) -> Backend:
            return DockerBackend(args.project, services=names, drain_timeout=args.drain_timeout)

        where = f"compose project {args.project}"
    for model, names in pools.items():
        log.info("autoscaling %s: %s and %s (%s)", model, names["prefill"], names["decode"], where)
    if not pools:
        log.info("autoscaling prefill and decode (%s)", where)
    backends = {model: make(names) for model, names in pools.items()}
    shared = shared_decode_service(pools)
    if shared is not None:
        log.info("%s: decode processes every model shares, scaled as one pool", shared)
    await run_controller(
        args,
        backends or make(None),
        args.nats,
        BusAuth.from_args(args),
        args.router_url,
        stop,
        None if shared is None else make(next(iter(pools.values()))),
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "autoscale", help="scale prefill and decode nodes (a compose project, or Kubernetes)"
    )
    add_option(p, "--nats", default="nats://127.0.0.1:4222", help="NATS server URL")
    add_nats_auth_options(p)
    add_option(p, "--router-url", default=None, help="router to read TTFT from")
    add_option(
        p, "--backend", default="docker", choices=["docker", "kubernetes"], help="what to scale"
    )
    add_option(p, "--project", default="tandem", help="Docker Compose project name")
    add_option(
        p,
        "--namespace",
        default=None,
        help="Kubernetes namespace of the Deployments (default: the pod's own)",
    )
    add_option(p, "--kubeconfig", default=None, help="outside a cluster: the kubeconfig file")
    add_option(
        p,
        "--pool",
        action="append",
        default=None,
        help="MODEL=PREFILL:DECODE: scale that model's nodes, held by these compose services "
        "or Deployments, as a pool of their own; repeat it for each model (default: one "
        "pool, the services or Deployments prefill and decode)",
    )
    add_option(
        p,
        "--drain-timeout",
        type=float,
        default=30.0,
        help="the decode nodes' --drain-timeout (a prefill node drains within 30 s); Docker "
        "stops a node after this plus 10 s",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="the router runs --conditional: the SLO policy sizes conditional deployments, "
        "and --prefill-min may be 0",
    )
    add_option(p, "--log-level", default="INFO")
    add_policy_options(p)
    add_metrics_options(p)
    p.set_defaults(func=lambda args: run_service(serve, args))
