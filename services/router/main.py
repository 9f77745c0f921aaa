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
from shared.bus.kv_events import KVIndex
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
    add_chunking_options,
    add_models_file_option,
    add_node_options,
    add_open_api_option,
    add_option,
    model_entries,
    open_api_problem,
    target_seconds,
)
from shared.runtime.service import freeze_startup_objects, run_service
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


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """What one request and all of them together may ask; API keys."""
    add_option(p, "--max-inflight", type=int, default=256, help="admitted requests; then 429")
    add_option(p, "--max-body-bytes", type=int, default=1 << 20)
    add_option(
        p,
        "--body-timeout",
        type=float,
        default=10.0,
        help="seconds a request's body may take to arrive once its headers did (then 408); "
        "a request counts against --max-inflight only once its body is in",
    )
    add_option(
        p,
        "--idle-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may stay without a whole request's headers: from when it "
        "opens, and from each response on (a slow or silent client holds no socket longer)",
    )
    add_option(p, "--max-tokens-limit", type=int, default=4096)
    add_option(p, "--max-prompt-tokens", type=int, default=None, help="default: model context")
    add_option(p, "--max-stop", type=int, default=4, help="stop strings per request")
    add_option(p, "--max-stop-len", type=int, default=256, help="characters per stop string")
    add_option(p, "--api-keys", default=None, help="comma-separated bearer keys (none: open API)")
    add_option(p, "--api-keys-file", default=None, help="file of bearer keys, one per line")
    add_option(p, "--max-inflight-per-key", type=int, default=64, help="then 429 for that key")
    add_option(p, "--metrics-auth", action="store_true", help="/metrics needs an API key too")
    add_open_api_option(p)


def add_failure_options(p: argparse.ArgumentParser) -> None:
    """Deadlines, liveness probes, the registry entry and the resume lease."""
    add_option(p, "--first-token-timeout", type=float, default=120.0)
    add_option(p, "--stall-timeout", type=float, default=30.0)
    add_option(
        p,
        "--probe-after",
        type=float,
        default=0.5,
        help="ping the node a stream waits on after this long without a token (0: never)",
    )
    add_option(
        p, "--request-timeout", type=float, default=600.0, help="deadline of a whole request"
    )
    add_option(
        p,
        "--heartbeat-ttl",
        type=float,
        default=3.0,
        help="this router's registry entry lapses this long after its last heartbeat",
    )
    add_option(
        p,
        "--resume-lease",
        type=float,
        default=5.0,
        help="seconds a client of a dead router has to resume its stream; then the request "
        "is cancelled and its KV blocks freed",
    )


def add_routing_options(p: argparse.ArgumentParser) -> None:
    """Where requests go: local prefill, standbys, colocated."""
    add_option(
        p,
        "--local-prefill-max-tokens",
        type=int,
        default=96,
        help="send a request to the decode node caching its prefix when at most this many "
        "prompt tokens are uncached there (0: always disaggregate)",
    )
    add_option(
        p,
        "--standby-after",
        type=int,
        default=16,
        help="delivered tokens after which another decode node loads a stream's stored KV, "
        "so that a failover there loads only what was stored since (0: no standby)",
    )
    add_option(
        p,
        "--colocated",
        action="store_true",
        help="no prefill nodes: every request is prefilled on a decode node (the baseline)",
    )
    add_option(
        p,
        "--conditional",
        action="store_true",
        help="per request, prefill on the decode node or on the prefill pool, whichever the "
        "costs say gives the first token sooner (see --profile)",
    )
    add_option(
        p,
        "--profile",
        default=None,
        help="a `tandem plan profile` JSON the conditional choice takes its costs from "
        "(without one: a fixed rule on the prefill pool's backlog)",
    )
    add_option(
        p,
        "--tpot-target",
        type=target_seconds,
        default=0.0,
        help="seconds a token: the conditional choice (with --profile) prefills on a decode "
        "node only while its running streams keep within this (0: no target)",
    )
    add_option(
        p,
        "--cache-isolation",
        choices=["auto", "shared", "key"],
        default="auto",
        help="shared: prefix caching across API keys (fastest; time to first token can tell "
        "a client whether another sent a prefix); key: each key's cached blocks its own; "
        "auto (default): key when API keys are configured, shared when the API is open",
    )
    add_chunking_options(p)  # the decode nodes' own: the conditional choice models them


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
    index = KVIndex()
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
    nodes = await NodeTable(await NodeRegistry(bus).start(), colocated=args.colocated).start()
    bus.on_reconnect.append(nodes.on_reconnect)
    journal = await RequestJournal(bus).start()
    config = config_of(args, node_id, models, keys.enabled)
    if config.isolate_cache_by_key:
        log.info("cached prefixes are shared only within an API key (--cache-isolation)")
    parts = RouterParts.of(config, bus, nodes, journal, tokenizers)
    router = Router(parts, tokenizers, await kv_routing(args, bus, nodes))
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
