"""The embedded stack: NATS and every service as child processes of this one (`tandem up`
runs it: tandem/up.py; tests, benchmarks and `tandem bench compare` start it too).

Starts `nats-server -js` (unless `--nats URL`), then kvcache ×K, prefill ×N, decode ×M and
the router;
returns control (prints the URL) once the router answers /readyz; prefixes every child's log
lines with its name; reports loudly a child that dies; on SIGINT/SIGTERM stops every child
(SIGTERM, then SIGKILL after a grace period) and the NATS server, leaving no process behind.
Children also get PR_SET_PDEATHSIG, so even a SIGKILLed launcher takes them down.

`--colocated` (or `--prefill 0`) starts no prefill node: each decode node prefills its own
requests, the one-engine baseline `tandem bench compare` measures disaggregation against.
`--pin-cores` pins each model node to one core of its own (round-robin), so N nodes on N
cores share the same hardware as one node on all of them, without stealing each other's.
`--prometheus-targets FILE` keeps FILE a Prometheus file_sd list of every running process's
/metrics (the router's API port, each node's metrics port), rewritten whenever a node starts
or exits (the autoscaler adds and removes them) and removed when the stack stops:
deploy/observability/ runs Prometheus, Grafana and Jaeger on it (docs/observability.md).
`--isolate-decode` gives each decode node's engine thread (its steps) a core that nothing
else uses, and puts every other process and thread (NATS, kvcache, prefill, router, the
decode nodes' event loops) on the remaining cores: a decode step then never waits for a
core while prompts are handed over (docs/benchmarks-log.md, "Where the split's ITL tail at
16 streams comes from").
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.bus.auth import BusAuth, ClusterAuth
from shared.bus.server import NatsServer, free_port
from shared.model.catalog import ModelEntry
from shared.model.source import DEFAULT_MODEL
from shared.procs import BACKGROUND_ROLES, child_setup
from shared.runtime.options import env_name, model_entries, step_token_budget
from tandem.metrics_targets import TargetsFile, scrape_address
from tandem.up_options import keys_given
from tandem.vllm_env import python_for

READY_TIMEOUT = 300.0
GRACE = 10.0


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[str] | None = None
    pump: threading.Thread | None = None
    reported: bool = field(default=False)


class Stack:
    """The launched processes; usable from tests as well as from the command."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nats: NatsServer | None = None
        self.nats_url: str = args.nats or ""
        self.auth = BusAuth.from_args(args)  # replaced by fresh ones for an embedded server
        # Per role (embedded server): each service gets its role's identity, self.auth is
        # the unrestricted admin. Empty: every service gets self.auth (an outside server).
        self.role_auth: dict[str, BusAuth] = {}
        self.children: list[Child] = []
        self.metrics_ports: dict[str, int] = {}  # node name → its /metrics port
        self.env: dict[str, str] = {}  # extra environment for every service (benchmarks)
        self.affinity: dict[str, set[int]] = {}  # child name → the CPUs it may run on
        self.engine_cpus: dict[str, set[int]] = {}  # decode node → its engine thread's CPUs
        self.shared_cpus: set[int] | None = None  # everything else's, when isolated
        self.core_share: Path | None = None  # the nodes' lent-cores bytes (core_share.py)
        self.out = sys.stdout
        self.lock = threading.Lock()
        # --prometheus-targets: the file_sd file kept listing the running processes
        self.targets = (
            TargetsFile(Path(args.prometheus_targets), self.say)
            if args.prometheus_targets
            else None
        )

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def say(self, line: str) -> None:
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _common(self, name: str | None = None) -> list[str]:
        """Options every service takes; nodes (not the router) also get a metrics port."""
        a = self.args
        out = ["--nats", self.nats_url, "--log-level", a.log_level]
        if name is not None:
            self.metrics_ports[name] = free_port()
            out += ["--node-id", name, "--metrics-port", str(self.metrics_ports[name])]
        return out

    def _model(self, threads: int, model: ModelEntry | None) -> list[str]:
        """A node's model options: `model`'s, or every model's (None: a decode node
        hosting them all, `--shared-decode`)."""
        a = self.args
        if model is not None:
            which = ["--model", model.option, "--dtype", model.dtype or a.dtype]
        elif a.models_file:
            which = ["--models-file", a.models_file, "--dtype", a.dtype]
        else:
            which = [arg for m in served_models(a) for arg in ("--model", m.option)]
            which += ["--dtype", a.dtype]
        return [
            *which,
            "--device",
            a.device,
            "--threads",
            str(threads),
        ]

    def plan(self) -> list[Child]:
        a = self.args
        prefill = prefill_nodes(a)
        models = served_models(a)
        # each model's nodes: `prefill` and `decode` of them, numbered on across models
        prefills = [
            (f"prefill-{i + 1}", models[i // prefill]) for i in range(prefill * len(models))
        ]
        decodes: list[tuple[str, ModelEntry | None]] = [
            (f"decode-{i + 1}", models[i // a.decode]) for i in range(a.decode * len(models))
        ]
        if a.shared_decode and len(models) > 1:
            decodes = [(f"decode-{i + 1}", None) for i in range(a.decode)]
        workers = len(prefills) + len(decodes)
        cpus = sorted(os.sched_getaffinity(0))
        if a.pin_cores:
            names = [name for name, _ in prefills + decodes]
            for k, name in enumerate(names):
                self.affinity.setdefault(name, {cpus[k % len(cpus)]})
        if a.isolate_decode:
            shared = self._isolate([name for name, _ in decodes], cpus)
            names = ["router", *(f"kvcache-{i + 1}" for i in range(a.kvcache))]
            for name in names + [name for name, _ in prefills + decodes]:
                self.affinity.setdefault(name, shared)

        def threads(name: str) -> int:
            # One torch thread per core a node may use: more would oversubscribe them.
            if name in self.engine_cpus:
                return int(a.threads or len(self.engine_cpus[name]))
            if name in self.affinity:
                share = len(prefills) if self.engine_cpus else 1  # isolated: prefills share
                return int(a.threads or max(1, len(self.affinity[name]) // share))
            return int(a.threads or max(1, len(cpus) // workers))

        chunking = [
            "--step-token-budget",
            str(step_token_budget(a.step_token_budget, split=prefill > 0)),
            "--prefill-chunk-tokens",
            str(a.prefill_chunk_tokens),
            *(["--no-prefill-bursts"] if a.no_prefill_bursts else []),
        ]
        data = [
            "--transport",
            a.transport,
            "--kv-cache-mb",
            str(a.kv_cache_mb),
            "--heartbeat-ttl",
            str(a.heartbeat_ttl),
            *chunking,
        ]
        out = []
        for i in range(a.kvcache):
            out.append(
                Child(
                    f"kvcache-{i + 1}",
                    [
                        "kvcache",
                        *self._common(f"kvcache-{i + 1}"),
                        "--transport",
                        a.transport,
                        "--capacity-mb",
                        str(a.kvcache_mb),
                        "--heartbeat-ttl",
                        str(a.heartbeat_ttl),
                    ],
                )
            )
        lending = self._lending([n for n, _ in prefills], [n for n, _ in decodes], cpus)
        for role, nodes in (("prefill", prefills), ("decode", decodes)):
            for name, model in nodes:
                pinned = self.engine_cpus.get(name)
                engine = ["--engine-cpus", ",".join(map(str, sorted(pinned)))] if pinned else []
                engine += lending.get(name, [])
                if role == "prefill":
                    engine += ["--idle-threads", str(self._idle_threads(len(cpus)))]
                if getattr(a, "engine", "native") != "native":
                    engine += ["--engine", a.engine]
                out.append(
                    Child(
                        name,
                        [
                            role,
                            *self._common(name),
                            *self._model(threads(name), model),
                            *data,
                            *engine,
                        ],
                    )
                )
        out.append(
            Child(
                "router",
                [
                    "router",
                    *self._common(),
                    "--node-id",
                    "router-1",
                    *(
                        ["--models-file", a.models_file]
                        if a.models_file
                        else [arg for model in models for arg in ("--model", model.option)]
                    ),
                    "--host",
                    a.host,
                    "--port",
                    str(a.port),
                    "--heartbeat-ttl",
                    str(a.heartbeat_ttl),
                    *(["--api-keys-file", a.api_keys_file] if a.api_keys_file else []),
                    *self._router_metrics(),
                    *(["--allow-open"] if a.allow_open else []),
                    *(["--colocated"] if prefill == 0 else []),
                    *(["--conditional"] if a.conditional and prefill else []),
                    *(["--profile", a.profile] if a.profile else []),
                    *(["--tpot-target", f"{a.tpot_target:g}"] if a.tpot_target else []),
                    *chunking,
                ],
            )
        )
        return out

    def _router_metrics(self) -> list[str]:
        """With API keys, the router serves /metrics only on a port of its own (tenants
        must not read its counters: services/router/main.py); open, on its API port."""
        if not keys_given(self.args):
            return []
        self.metrics_ports["router"] = free_port()
        return ["--metrics-port", str(self.metrics_ports["router"])]

    def _idle_threads(self, cores: int) -> int:
        """A prefill node's threads for a batch sent while the router served nothing else
        (`--idle-threads`): every core, where the nodes share them (the decode nodes are
        idle then); 0 (its usual count) where --isolate-decode or --pin-cores keeps the
        nodes on cores of their own, or as --prefill-idle-threads says."""
        a = self.args
        if a.prefill_idle_threads is not None:
            return int(a.prefill_idle_threads)
        return 0 if a.isolate_decode or a.pin_cores else cores

    def _lending(
        self, prefills: list[str], decodes: list[str], cpus: list[int]
    ) -> dict[str, list[str]]:
        """Each node's `--core-share` options: where one decode node shares the host's
        cores with prefill nodes (nothing pinned, no autoscaler adding nodes, the native
        engine), it steps on every core while they are idle (shared/runtime/core_share.py);
        nothing otherwise, or with --no-core-lending."""
        a = self.args
        if (
            a.no_core_lending
            or a.pin_cores
            or a.isolate_decode
            or getattr(a, "autoscale", False)
            or getattr(a, "engine", "native") != "native"
            or len(decodes) != 1
            or not prefills
            or len(cpus) < 2
        ):
            return {}
        # The nodes create it (plan() may run without a start), with a name no one can
        # guess, following no symlink, readable by this user only; its bytes choose
        # thread counts, nothing else.
        shm = Path("/dev/shm")  # noqa: S108
        where = shm if shm.is_dir() else Path(tempfile.gettempdir())
        self.core_share = where / f"tandem-cores-{os.getpid()}-{secrets.token_hex(6)}"
        share = ["--core-share", str(self.core_share)]
        out = {name: [*share, "--core-share-slot", str(i)] for i, name in enumerate(prefills)}
        out[decodes[0]] = [*share, "--lend-threads", str(len(cpus))]
        return out

    def _isolate(self, decodes: list[str], cpus: list[int]) -> set[int]:
        """--isolate-decode: the last len(decodes) CPUs, one per decode node's engine
        thread; the others, returned, for everything else (a SystemExit if none would be
        left)."""
        if len(cpus) <= len(decodes):
            raise SystemExit(
                f"error: --isolate-decode needs more CPUs than decode nodes: {len(decodes)} "
                f"decode node(s), CPUs {cpus}"
            )
        for name, cpu in zip(decodes, cpus[-len(decodes) :], strict=True):
            self.engine_cpus[name] = {cpu}
        self.shared_cpus = set(cpus[: -len(decodes)])
        return self.shared_cpus

    def start(self) -> None:
        if self.targets is not None:  # before anything starts: an unwritable file stops it
            self.targets.open(self.metrics_targets())
        if not self.nats_url:
            # Per-run credentials: nothing else on this machine can use our NATS, and each
            # service only the subjects its role uses (shared/bus/permissions.py).
            cluster = ClusterAuth.generate()
            self.auth, self.role_auth = cluster.admin, cluster.roles
            self.nats = NatsServer(
                port=self.args.nats_port or free_port(), extra_config=cluster.server_config()
            ).start()
            self.nats_url = self.nats.url
            self.say(f"[up] nats-server -js at {self.nats_url}")
        children = self.plan()
        if self.nats is not None and self.shared_cpus:
            self.nats.run_on(self.shared_cpus)  # off the decode engines' cores too
        for child in children:
            self._spawn(child)
            self.children.append(child)
        self.refresh_targets()

    def auth_for(self, role: str) -> BusAuth:
        """The NATS identity a service of `role` connects with."""
        return self.role_auth.get(role, self.auth)

    def child_env(self, child: Child) -> dict[str, str]:
        """The environment `child` starts with. Credentials travel in it: a command line
        is visible to `ps`. API keys go to the router alone: no other node needs them."""
        auth = self.auth_for(child.argv[0])  # the sub-command: its role
        env = dict(os.environ, PYTHONUNBUFFERED="1", **auth.env(), **self.env)
        env.pop("TANDEM_API_KEYS", None)
        if self.args.api_keys and child.name == "router":
            env["TANDEM_API_KEYS"] = self.args.api_keys
        if self.args.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.args.otlp_endpoint
        return env

    def nice(self, child: Child) -> int:
        """The niceness `child` runs at: the prefill and kvcache nodes' work (prefills, KV
        stores) waits for the decode steps where they share cores."""
        return int(self.args.background_nice) if child.argv[0] in BACKGROUND_ROLES else 0

    def _spawn(self, child: Child) -> None:
        env = self.child_env(child)
        child.proc = subprocess.Popen(
            [python_for(child.argv), "-m", "tandem.cli", *child.argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            # Own session: terminal signals reach only this launcher, which stops the
            # services first and NATS last; PDEATHSIG covers a launcher that is killed.
            start_new_session=True,
            preexec_fn=functools.partial(
                child_setup, self.affinity.get(child.name), self.nice(child)
            ),
        )

        def pump() -> None:
            assert child.proc is not None and child.proc.stdout is not None
            for line in child.proc.stdout:
                self.say(f"[{child.name}] {line.rstrip()}")

        child.pump = threading.Thread(target=pump, daemon=True)
        child.pump.start()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def add(self, child: Child) -> None:
        """Start one more service while the stack runs (the autoscaler's local backend)."""
        self._spawn(child)
        self.children.append(child)
        self.refresh_targets()

    def kill(self, name: str) -> None:
        """SIGKILL one service (chaos tests); `restart` brings it back with the same options."""
        c = self.child(name)
        assert c.proc is not None
        c.proc.kill()
        c.proc.wait()
        c.reported = True
        if c.pump is not None:
            c.pump.join(timeout=2)
        self.refresh_targets()

    def terminate(self, name: str) -> None:
        """SIGTERM one service: a graceful stop (a decode node drains first)."""
        c = self.child(name)
        assert c.proc is not None
        c.reported = True  # an exit we asked for
        c.proc.terminate()

    def restart(self, name: str) -> None:
        c = self.child(name)
        if c.proc is not None and c.proc.poll() is None:
            self.kill(name)
        if c.proc is not None and c.proc.stdout is not None:
            c.proc.stdout.close()
        c.reported = False
        self._spawn(c)
        self.refresh_targets()

    def dead_children(self) -> list[Child]:
        dead = []
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None and not c.reported:
                c.reported = True
                dead.append(c)
        # `tandem up` polls this twice a second: where a node that exited (a drained one
        # the autoscaler stopped, or a crash) leaves the targets file.
        self.refresh_targets()
        return dead

    # ---- --prometheus-targets --------------------------------------------------------------

    def metrics_targets(self) -> list[dict[str, Any]]:
        """The Prometheus file_sd target groups of the running processes, labelled as
        deploy/prometheus.yml labels compose's: job `router` (its API port serves /metrics)
        or `nodes` with the node's `role`, plus its `node` name; `instance` stays the
        address, as there. The router's group has no role or node label: its own
        `tandem_node_requests_total{role,node}` would lose them (Prometheus renames a
        scraped label that a target label takes to exported_*)."""
        groups: list[dict[str, Any]] = []
        for c in list(self.children):  # the autoscaler's thread may be appending
            if c.proc is None or c.proc.poll() is not None:
                continue
            if c.name == "router":
                address = scrape_address(self.args.host, int(self.args.port))
                if c.name in self.metrics_ports:  # keyed: its own port (_router_metrics)
                    address = scrape_address(self._metrics_host(c), self.metrics_ports[c.name])
                groups.append({"targets": [address], "labels": {"job": "router"}})
            elif c.name in self.metrics_ports:
                address = scrape_address(self._metrics_host(c), self.metrics_ports[c.name])
                labels = {"job": "nodes", "role": c.argv[0], "node": c.name}
                groups.append({"targets": [address], "labels": labels})
        return groups

    def _metrics_host(self, child: Child) -> str:
        """The address a node's /metrics listens on: its --metrics-host, which (the
        launcher passing none) its environment may set, else the option's default."""
        if "--metrics-host" in child.argv:
            return child.argv[child.argv.index("--metrics-host") + 1]
        var = env_name("--metrics-host")
        return self.env.get(var, os.environ.get(var, "127.0.0.1"))

    @property
    def targets_file(self) -> Path | None:
        return self.targets.path if self.targets is not None else None

    def refresh_targets(self) -> None:
        """Rewrite the targets file if the running processes changed (--prometheus-targets)."""
        if self.targets is not None:
            self.targets.refresh(self.metrics_targets)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for c in self.dead_children():
                raise RuntimeError(f"{c.name} exited with code {exit_code(c)} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as resp:  # noqa: S310 - our own URL
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"stack not ready within {timeout:.0f}s")

    def stop(self) -> None:
        if self.targets is not None:  # first: Prometheus stops scraping what is to go
            self.targets.remove()
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + GRACE
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"[up] {c.name} did not stop in {GRACE:.0f}s: killing it")
                c.proc.kill()
                c.proc.wait()
        for c in self.children:
            if c.pump is not None:
                c.pump.join(timeout=2)
            if c.proc is not None and c.proc.stdout is not None:
                c.proc.stdout.close()
        if self.nats is not None:
            self.nats.cleanup()
            self.nats = None
        if self.core_share is not None:
            self.core_share.unlink(missing_ok=True)
            self.core_share = None


def served_models(args: argparse.Namespace) -> list[ModelEntry]:
    """The models the stack serves: its models file's, or its `--model` values (the default
    model when none)."""
    return model_entries(args, DEFAULT_MODEL)


def prefill_nodes(args: argparse.Namespace) -> int:
    """Prefill nodes to start: none when colocated (and on vLLM's engine, which serves
    colocated only for now), else --prefill (default 1)."""
    if args.colocated or getattr(args, "engine", "native") == "vllm":
        return 0
    return 1 if args.prefill is None else int(args.prefill)


def exit_code(child: Child) -> str:
    """A child's exit code for messages ("?" if it never started)."""
    return str(child.proc.returncode) if child.proc is not None else "?"
