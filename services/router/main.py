"""`tandem router`: the HTTP front end, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence

from aiohttp import web

from services.router.app import Router
from services.router.auth import ApiKeys, read_keys
from services.router.conditional import PrefillPathChooser
from services.router.config import RouterConfig
from services.router.flags import add_failure_options, add_limit_options, add_routing_options
from services.router.http_app import build_app
from services.router.janitor import Janitor
from services.router.liveness import LivenessProbe, ProbeTiming
from services.router.nodes import NodeTable
from services.router.parts import RouterParts
from services.router.routing import PrefixRouter
from services.router.validation import Limits
from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.bus.journal import RequestJournal
from shared.bus.kv_events import UNADVERTISED_CAPACITY, KVIndex
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.topology import TopologyConfig
from shared.costs.model import CostModel
from shared.costs.profile import read_profile
from shared.errors import ModelLoadError
from shared.model.catalog import ModelEntry
from shared.model.source import DEFAULT_MODEL
from shared.model.tokenizer import TokenizerInfo, load_tokenizer
from shared.runtime.node import connect_bus, make_node_id, setup_logging, stop_on_signals
from shared.runtime.options import (
    add_models_file_option,
    add_node_options,
    add_option,
    model_entries,
    open_api_problem,
)
from shared.runtime.service import freeze_startup_objects, run_service
from shared.telemetry.metrics import serve_registry
from shared.telemetry.tracing import setup_tracing

log = logging.getLogger("tandem.router")
INDEX_GRACE = 60.0  # seconds a departed node's KV index entries are kept for its return


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router", help="run the HTTP router (OpenAI-compatible API)")
    add_node_options(p, model=False, metrics_port=False)
    add_option(
        p,
        "--model",
        action="append",
        default=None,
        help="a served model (its tokenizer), SOURCE or NAME=SOURCE; repeat it for several "
        f"(default {DEFAULT_MODEL}; the first is /tokenize's default)",
    )
    add_models_file_option(p)
    add_option(p, "--host", default="127.0.0.1")
    add_option(p, "--port", type=int, default=8000)
    add_limit_options(p)
    add_failure_options(p)
    add_routing_options(p)
    p.set_defaults(func=run)


def config_of(
    args: argparse.Namespace,
    node_id: str,
    models: Sequence[ModelEntry] = (),
    keyed: bool = False,
) -> RouterConfig:
    """The router's settings; `models`' own limits (a models file's) beside the server's.
    `keyed`: API keys are configured (then `--cache-isolation auto` isolates by key)."""
    per_model = {
        m.name: (m.max_tokens_limit, m.max_prompt_tokens)
        for m in models
        if m.name is not None and (m.max_tokens_limit or m.max_prompt_tokens)
    }
    return RouterConfig(
        node_id=node_id,
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        first_token_timeout=args.first_token_timeout,
        stall_timeout=args.stall_timeout,
        request_timeout=args.request_timeout,
        limits=Limits(
            max_tokens=args.max_tokens_limit,
            max_prompt_tokens=args.max_prompt_tokens,
            max_stop=args.max_stop,
            max_stop_len=args.max_stop_len,
            per_model=per_model,
        ),
        colocated=args.colocated,
        standby_after=args.standby_after,
        isolate_cache_by_key=isolates_by_key(args.cache_isolation, keyed),
    )


def isolates_by_key(setting: str, keyed: bool) -> bool:
    """Whether each API key's cached blocks are its own. With keys there are tenants, and
    a shared cache lets one tell from its time to first token whether another sent a
    prefix: isolated unless `--cache-isolation shared` says otherwise. Without keys there
    is one tenant: nothing to isolate."""
    return setting == "key" or (setting == "auto" and keyed)


def metrics_refusal(args: argparse.Namespace, keyed: bool) -> str | None:
    """Why the API port does not serve /metrics, or None where it does. Its counters (routes
    taken, prefix-cache hits) tell one tenant what others sent, so with API keys configured
    it is served only on --metrics-port, where operators reach it, unless --metrics-auth
    lets any key read it. An open API has one tenant: served there too (issue 49)."""
    if not keyed or args.metrics_auth:
        return None
    if args.metrics_port is not None:
        return "/metrics is served on the router's metrics port, not the API port"
    return (
        "/metrics is not served on the API port when API keys are configured: the operator "
        "serves it on --metrics-port (or lets any API key read it: --metrics-auth)"
    )


def api_keys(args: argparse.Namespace) -> ApiKeys:
    keys = ApiKeys.of(
        read_keys(args.api_keys, args.api_keys_file),
        args.max_inflight_per_key,
        args.metrics_auth,
    )
    problem = open_api_problem(args.host, keys.enabled, args.allow_open)
    if problem:
        raise SystemExit(f"error: {problem}")
    if not keys.enabled:
        log.warning("no API keys configured: the API is open to anyone who can reach it")
    return keys


async def kv_routing(args: argparse.Namespace, bus: Bus, nodes: NodeTable) -> PrefixRouter:
    """KV-aware routing over the cluster's KV events; a node that left keeps its entries
    for INDEX_GRACE (a missed heartbeat or two must not wipe them)."""

    def capacity(node_id: str) -> int | None:
        info = nodes.nodes.get(node_id)  # a node not registered announces nothing
        return None if info is None else info.total_kv_blocks or UNADVERTISED_CAPACITY

    index = KVIndex(capacity)
    await index.follow(bus)
    bus.on_reconnect.append(lambda: index.refollow(bus))
    loop = asyncio.get_running_loop()

    def forget(node_id: str) -> None:
        if node_id not in nodes.nodes:  # it did not come back
            index.drop_node(node_id)

    def forget_later(node_id: str) -> None:
        loop.call_later(INDEX_GRACE, forget, node_id)

    nodes.on_leave.append(forget_later)
    chooser = path_chooser(args) if args.conditional and not args.colocated else None
    return PrefixRouter(
        nodes, index, args.local_prefill_max_tokens, colocated=args.colocated, chooser=chooser
    )


def path_chooser(args: argparse.Namespace) -> PrefillPathChooser:
    """Conditional disaggregation's chooser, with the profile's costs if one is given."""
    costs = None
    if args.profile:
        try:
            costs = CostModel(read_profile(args.profile))
        except ValueError as exc:
            raise SystemExit(f"error: --profile: {exc}") from exc
    if args.tpot_target and costs is None:
        raise SystemExit("error: --tpot-target needs --profile (the costs it is kept with)")
    log.info(
        "conditional disaggregation, %s%s",
        "with costs from " + args.profile if costs else "fallback rule (no profile)",
        f", TPOT target {args.tpot_target:g}s" if args.tpot_target else "",
    )
    return PrefillPathChooser(
        costs,
        args.local_prefill_max_tokens,
        step_budget=args.step_token_budget,
        chunk_tokens=args.prefill_chunk_tokens,
        tpot_target=args.tpot_target,
    )


def load_tokenizers(models: list[str]) -> dict[str, TokenizerInfo]:
    """Each served model's tokenizer, by its served name (a name given twice is an error:
    a request could not say which it means)."""
    out: dict[str, TokenizerInfo] = {}
    for model in models:
        tok = load_tokenizer(model)
        if tok.served_name in out:
            raise ModelLoadError(f"two models are served as {tok.served_name!r}")
        out[tok.served_name] = tok
    return out


async def serve(args: argparse.Namespace) -> None:
    node_id = make_node_id("router", args.node_id)
    setup_logging("router", node_id, args.log_level)
    setup_tracing("router", node_id)
    keys = api_keys(args)
    models = model_entries(args, DEFAULT_MODEL)
    tokenizers = load_tokenizers([m.option for m in models])
    stop = stop_on_signals()
    topology = TopologyConfig(replicas=args.nats_replicas)
    bus = await connect_bus(args.nats, node_id, BusAuth.from_args(args), topology, stop=stop)
    nodes = NodeTable(
        await NodeRegistry(bus).start(),
        colocated=args.colocated,
        # a conditional router prefills on decode nodes while no prefill node is up
        prefill_optional=args.conditional and not args.colocated,
    )
    await nodes.start()
    bus.on_reconnect.append(nodes.on_reconnect)
    journal = await RequestJournal(bus).start()
    config = config_of(args, node_id, models, keys.enabled)
    if config.isolate_cache_by_key:
        log.info("cached prefixes are shared only within an API key (--cache-isolation)")
    parts = RouterParts.of(config, bus, nodes, journal, tokenizers)
    router = Router(parts, tokenizers, await kv_routing(args, bus, nodes))
    router.metrics_refusal = metrics_refusal(args, keys.enabled)
    if args.metrics_port is not None:
        port = serve_registry(parts.metrics.registry, args.metrics_port, args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, port)
    elif router.metrics_refusal is not None:
        log.warning("%s", router.metrics_refusal)  # no /metrics anywhere: say so
    # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
    # then cancels the request on every node.
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request's
    # headers this long after it opened or after its last response (its default, 3,630 s,
    # let a stranger hold sockets for an hour).
    runner = web.AppRunner(
        build_app(router, keys),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=args.idle_timeout,
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("router %s listening on http://%s:%d", node_id, args.host, args.port)
    # In the registry like every node: other routers' janitors see whether it lives.
    beats = await NodeRegistry(bus, ttl=args.heartbeat_ttl).start()
    heartbeats = asyncio.create_task(
        beats.run_heartbeats(lambda: node_info(node_id, "router", load=parts.inflight.admitted))
    )
    tasks = [asyncio.create_task(Janitor(parts, args.resume_lease).run(stop))]
    if args.probe_after > 0:
        timing = ProbeTiming(probe_after=args.probe_after)
        probe = LivenessProbe(
            bus, parts.inflight, nodes, parts.metrics, parts.inflight.node_lost, timing
        )
        tasks.append(asyncio.create_task(probe.run(stop)))
    freeze_startup_objects()  # its tokenizers' and libraries' objects: see the docstring
    try:
        await stop.wait()
    finally:
        for task in tasks:
            await task
        heartbeats.cancel()
        with contextlib.suppress(Exception):  # else the entry lapses by its TTL
            await asyncio.wait_for(beats.remove("router", node_id), 1.0)
        await runner.cleanup()
        await nodes.close()
        await bus.close()


def run(args: argparse.Namespace) -> int:
    return run_service(serve, args)
