"""`tandem autoscale`: the autoscaler over a Docker Compose project or a Kubernetes namespace.

    tandem autoscale --nats nats://HOST:4222 --router-url http://HOST:8000 \\
        --project tandem --decode-max 4 --prefill-max 2
    tandem autoscale --backend kubernetes --namespace tandem ...

reads the cluster from NATS (credentials as for every service: TANDEM_NATS_USER/PASSWORD)
and scales `prefill` and `decode`: the compose services through the Docker SDK, or the
Deployments through the Kubernetes API (in a pod, with its service account:
deploy/kubernetes/base/autoscaler.yaml). With `tandem up --autoscale` the same controller scales the
local stack's processes instead.
"""

from __future__ import annotations

import argparse
import logging

from shared.bus.auth import BusAuth
from shared.runtime.node import setup_logging, stop_on_signals
from shared.runtime.options import add_nats_auth_options, add_option
from shared.runtime.service import run_service
from tandem.autoscale.controller import run_controller
from tandem.autoscale.options import add_policy_options
from tandem.autoscale.types import Backend

log = logging.getLogger("tandem.autoscale")


async def serve(args: argparse.Namespace) -> None:
    setup_logging("autoscale", "autoscaler", args.log_level)
    stop = stop_on_signals()
    backend: Backend
    if args.backend == "kubernetes":
        from tandem.autoscale.kubernetes_backend import KubernetesBackend

        backend = KubernetesBackend.from_environment(args.namespace, args.kubeconfig)
        log.info("autoscaling Deployments prefill and decode in namespace %s", backend.namespace)
    else:
        from tandem.autoscale.docker_backend import DockerBackend

        backend = DockerBackend(args.project, drain_timeout=args.drain_timeout)
        log.info("autoscaling compose project %s", args.project)
    await run_controller(args, backend, args.nats, BusAuth.from_args(args), args.router_url, stop)


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
        p, "--drain-timeout", type=float, default=30.0, help="the decode nodes' --drain-timeout"
    )
    add_option(p, "--log-level", default="INFO")
    add_policy_options(p)
    p.set_defaults(func=lambda args: run_service(serve, args))
