"""Command-line options that also read `TANDEM_<OPTION>` environment variables, and the
option groups every service shares (bus, node, data plane, engine).

Every option of every `tandem` command can be set from the environment (what compose and
Kubernetes use): `--max-tokens` reads `TANDEM_MAX_TOKENS`, `--nats` reads `TANDEM_NATS`, and
so on. An explicit flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path
from typing import Any, cast

from shared.model.catalog import ModelEntry, ModelsFileError, read_models_file
from shared.model.source import DEFAULT_MODEL as DEFAULT_MODEL  # the nodes read it here
from shared.transport.kinds import NODE_TRANSPORT, TRANSPORTS


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """`parser.add_argument(flag, ...)` with its default taken from the environment if set."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kwargs.get("action") == "append":
            kwargs["default"] = [v for v in raw.split(",") if v]
        else:
            convert = kwargs.get("type", str)
            try:
                kwargs["default"] = convert(raw)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                raise SystemExit(f"error: {env}={raw!r} is not a valid value: {exc}") from exc
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {env}]".strip()
    parser.add_argument(flag, **kwargs)


def add_model_options(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The model (`several`: each of the models, `--model` repeated) and how it runs."""
    if several:
        add_option(
            parser,
            "--model",
            action="append",
            default=None,
            help="a model to serve: served name, Hugging Face directory or .gguf file, or "
            "NAME=SOURCE; repeat it for several (default smollm2-135m-instruct)",
        )
        add_models_file_option(parser)
    else:
        add_option(
            parser,
            "--model",
            default=DEFAULT_MODEL,
            help="served name, Hugging Face directory or .gguf file, or NAME=SOURCE",
        )
    add_option(parser, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_option(parser, "--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_option(parser, "--threads", type=int, default=None, help="torch threads (default: cores)")


def add_models_file_option(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--models-file",
        default=None,
        help="a TOML file of the models to serve, each with its own dtype and request limits "
        "(shared/model/catalog.py; instead of --model)",
    )


def model_entries(args: argparse.Namespace, default: str) -> list[ModelEntry]:
    """The models a command serves: its models file's, or its `--model` values (`default`
    when none). Both at once is an error, as is a bad file: SystemExit with the reason."""
    models = args.model if isinstance(args.model, list) else [args.model]
    models = [m for m in models if m]
    if getattr(args, "models_file", None):
        if models:
            raise SystemExit("error: give the models with --models-file or --model, not both")
        try:
            return read_models_file(args.models_file)
        except ModelsFileError as exc:
            raise SystemExit(f"error: {exc}") from exc
    return [ModelEntry(None, m) for m in models or [default]]


def nats_password_file(path: str) -> str:
    """--nats-password-file: the password a file holds (a mounted Docker or Kubernetes
    secret), without the whitespace around it (a final line end). A missing, unreadable or
    empty file is an error that names it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"no such file {path}") from None
    except OSError as exc:  # a directory, no permission, ...
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text") from None
    password = text.strip()
    if not password:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    if len(password.splitlines()) > 1:
        raise argparse.ArgumentTypeError(f"{path} has more than one line: the password alone")
    return password


def add_nats_auth_options(p: argparse.ArgumentParser) -> None:
    """Credentials for NATS; pass secrets by environment or in a file, not flags (`ps`
    shows flags).

    The password comes from --nats-password or --nats-password-file (not both on one command
    line), each also a variable; both fill `args.nats_password`, the one field `BusAuth`
    reads. A flag wins over both variables, and TANDEM_NATS_PASSWORD, if set at all, over
    TANDEM_NATS_PASSWORD_FILE, whose file is then not read: `tandem up` hands its services
    TANDEM_NATS_PASSWORD while they inherit the caller's variables. The file is read when
    the parser is built, as every TANDEM_* default is converted: a bad one stops the command
    at once, with its reason and no traceback."""
    add_option(p, "--nats-user", default=None, help="NATS user name")
    file_env = env_name("--nats-password-file")
    from_file = None
    path = os.environ.get(file_env)
    if path and env_name("--nats-password") not in os.environ:
        try:
            from_file = nats_password_file(path)
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"error: {file_env}={path!r}: {exc}") from None
    password = p.add_mutually_exclusive_group()
    # The file's password is --nats-password's default, which TANDEM_NATS_PASSWORD replaces.
    # (add_option calls only add_argument, which a group has as a parser does.)
    add_option(
        cast(argparse.ArgumentParser, password),
        "--nats-password",
        default=from_file,
        help="NATS password",
    )
    # Not add_option: its variable is read above. No default of its own (SUPPRESS; a string
    # default would go through `type`, read as a path): args.nats_password defaults to
    # --nats-password's.
    password.add_argument(
        "--nats-password-file",
        dest="nats_password",
        type=nats_password_file,
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="file holding the NATS password, e.g. a mounted secret (instead of "
        f"--nats-password; TANDEM_NATS_PASSWORD wins over it) [env {file_env}]",
    )
    add_option(p, "--nats-creds", default=None, help="NATS NKEY/JWT credentials file")
    add_option(p, "--nats-tls-ca", default=None, help="CA file: connect to NATS over TLS")


def add_node_options(
    p: argparse.ArgumentParser, model: bool = True, metrics_port: bool = True
) -> None:
    add_option(
        p,
        "--nats",
        default="nats://127.0.0.1:4222",
        help="NATS server URL (a cluster's: several, comma-separated)",
    )
    add_nats_auth_options(p)
    add_option(
        p,
        "--nats-replicas",
        type=int,
        default=1,
        help="servers of a NATS cluster keeping each stream (3 on Kubernetes; the same "
        "for every service)",
    )
    add_option(p, "--node-id", default=None, help="unique node name (default: role-host-random)")
    add_option(p, "--log-level", default="INFO")
    if metrics_port:  # the router serves /metrics on its API port instead
        add_option(p, "--metrics-port", type=int, default=None, help="serve /metrics (0: any port)")
        add_option(
            p,
            "--metrics-host",
            default="127.0.0.1",
            help="address /metrics listens on (0.0.0.0 for a Prometheus elsewhere)",
        )
    if model:
        add_model_options(p)


def add_data_plane_options(p: argparse.ArgumentParser) -> None:
    add_option(p, "--transport", default=NODE_TRANSPORT, choices=TRANSPORTS, help="KV data plane")
    add_option(
        p,
        "--data-host",
        default="127.0.0.1",
        help="address peers reach this node at (auto: this host's address); the TCP "
        "transport listens on it alone, UCX on every interface",
    )
    add_option(p, "--data-port", type=int, default=0, help="data-plane port (0: any free)")


STEP_TOKEN_BUDGET = 256  # measured: docs/benchmarks-log.md, "Chunked prefill"
# A decode node beside a prefill pool prefills locally only now and then (short tails,
# conditional disaggregation's choice); its running streams come first, so its chunks are
# smaller. Simulated, 64 gave a third of 256's ITL p99 at the same SLO attainment; measured,
# it kept the ITL p99 under chunked colocated's at every rate where 256 did not, with
# attainment within the runs' noise (docs/benchmarks-log.md, "A smaller step budget").
SPLIT_STEP_TOKEN_BUDGET = 64
PREFILL_CHUNK_TOKENS = 512


def step_token_budget(given: int | None, split: bool) -> int:
    """The decode nodes' step budget: `given`, else the default for the deployment
    (colocated nodes, or decode nodes beside prefill nodes)."""
    if given is not None:
        return given
    return SPLIT_STEP_TOKEN_BUDGET if split else STEP_TOKEN_BUDGET


def add_chunking_options(p: argparse.ArgumentParser, deployment: bool = False) -> None:
    """The decode nodes' chunked prefill (the router's conditional choice reads the same).
    For a command deploying nodes (`deployment`), the budget defaults to None: the
    deployment's own (`step_token_budget`)."""
    add_option(
        p,
        "--step-token-budget",
        type=int,
        default=None if deployment else STEP_TOKEN_BUDGET,
        help="chunked prefill: tokens one engine step computes, decodes and a prompt chunk "
        "together, while sequences run (0: prefill each prompt whole)"
        + (
            f"; default {STEP_TOKEN_BUDGET} colocated, {SPLIT_STEP_TOKEN_BUDGET} on decode "
            "nodes beside prefill nodes"
            if deployment
            else ""
        ),
    )
    add_option(
        p,
        "--prefill-chunk-tokens",
        type=int,
        default=PREFILL_CHUNK_TOKENS,
        help="chunked prefill: prompt tokens one step computes at most",
    )
    add_option(
        p,
        "--no-prefill-bursts",
        action="store_true",
        help="chunk a burst of short prompts too (by default, when more prompts of at most "
        "one chunk wait than streams run, they are prefilled whole in one step)",
    )


def cpu_list(text: str) -> set[int]:
    """`1`, `0,2` or `2-3` (the notation of taskset and /proc): a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            msg = f"{text!r} is not a CPU list like 1 or 0,2-3"
            raise argparse.ArgumentTypeError(msg) from None
        if low < 0 or high < low:
            raise argparse.ArgumentTypeError(f"{text!r}: {part.strip()!r} is not a CPU range")
        cpus.update(range(low, high + 1))
    return cpus


def whole_number(text: str, low: int, high: int | None = None) -> int:
    """An option's whole number from `low` to `high` (None: no upper bound), or an
    argparse error that says which."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if high is None and value < low:
        raise argparse.ArgumentTypeError(f"{value} is not at least {low}")
    if high is not None and not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not between {low} and {high}")
    return value


def niceness(text: str) -> int:
    """--background-nice: 0 (as every other process) to 19 (the lowest priority)."""
    return whole_number(text, 0, 19)


# Jobs a prefill node prefills together at most. A batch's first tokens all come at its end,
# and on a CPU a few hundred prompt rows already run the GEMMs near peak, so a larger batch
# only holds back the first tokens of its earlier prompts: at 16 streams of 256-token
# prompts on 2 cores, 4 gave 1.06x the tokens/s of 8 and TTFT p50 2.9 s against 5.1
# (docs/benchmarks-log.md, "Smaller prefill batches").
PREFILL_MAX_BATCH = 4
# Prompt tokens one of its steps computes at most: a batch is prefilled in steps, shortest
# first, and each step's first tokens go out as it ends (shared/engine/prefill_steps.py).
# On a CPU a step of a few hundred rows already runs near peak (profile, one AVX2 core:
# 8.1 ms a token at 64, 7.2 at 256, 7.8 at 1,024), so a small cap costs no throughput;
# simulated and measured on the mixed workload, 512 against 4,096: docs/benchmarks-log.md.
PREFILL_STEP_TOKENS = 512


def positive(text: str) -> int:
    """A count that must be at least 1."""
    return whole_number(text, 1)


def target_seconds(text: str) -> float:
    """--tpot-target and the like: seconds, 0 (no target) or more, finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: 0 (none) or a finite number of seconds")
    return value


def thread_count(text: str) -> int:
    """--idle-threads and the like: 0 (the default) or a number of threads, at most 1024."""
    return whole_number(text, 0, 1024)


ENGINES = ("native", "vllm")


def add_engine_choice(p: argparse.ArgumentParser) -> None:
    """--engine: the model nodes' engine (a node's, and `tandem up`'s for its nodes)."""
    add_option(
        p,
        "--engine",
        choices=ENGINES,
        default="native",
        help="the engine that runs the model: Tandem's own (native) or vLLM's, in-process "
        "(vllm: from the environment `make vllm` builds; colocated decode nodes only for "
        "now, docs/engines.md)",
    )


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add_engine_choice(p)
    add_option(p, "--kv-cache-mb", type=int, default=1024, help="KV cache size per node")
    add_option(
        p,
        "--engine-cpus",
        type=cpu_list,
        default=None,
        help="run the engine thread (every step) on these CPUs only, e.g. 1 or 2-3; the "
        "node's other threads keep the process's (default: the process's)",
    )
    add_option(p, "--max-num-seqs", type=int, default=64)
    add_option(p, "--max-batched-tokens", type=int, default=4096)
    add_chunking_options(p)
    add_option(p, "--heartbeat-ttl", type=float, default=6.0)
    add_option(
        p,
        "--no-kvcache",
        action="store_true",
        help="do not load prefixes from or store blocks in the kvcache service",
    )
    add_option(
        p,
        "--no-prefix-caching",
        action="store_true",
        help="never reuse KV across requests, not even from this node's own pool",
    )


def add_engine_node_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    role: str,
    help: str,
    several_models: bool = False,
) -> argparse.ArgumentParser:
    """The subcommand of a node that runs an engine (prefill, decode): the node's, the data
    plane's and the engine's options; the caller adds its own and its `func`.
    `several_models`: `--model` repeated, or `--models-file` (a node hosting them all)."""
    p = sub.add_parser(role, help=help)
    add_node_options(p, model=False)
    add_model_options(p, several=several_models)
    add_data_plane_options(p)
    add_engine_options(p)
    return p


def add_open_api_option(p: argparse.ArgumentParser) -> None:
    """--allow-open: the router's, and `tandem up`'s for its router (`open_api_problem`)."""
    add_option(
        p,
        "--allow-open",
        action="store_true",
        help="serve with no API keys on a --host beyond loopback (refused without it)",
    )


def open_api_problem(host: str, keys_given: bool, allow_open: bool) -> str | None:
    """Why a router on `host` must not start, if it would serve an open API (no keys) beyond
    this machine without `--allow-open` saying so on purpose; None if it may."""
    if keys_given or allow_open or is_loopback(host):
        return None
    return (
        f"the API would listen on {host} with no API keys, open to anyone who reaches it: "
        "set TANDEM_API_KEYS or --api-keys-file, or pass --allow-open (TANDEM_ALLOW_OPEN=1) "
        "to serve it open on purpose"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (a listening address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False
