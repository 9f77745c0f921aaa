"""Draw one real request's trace: every span the services exported, on one time axis.

Starts a stack (1 prefill, 1 decode, 1 kvcache node) exporting OTLP to an in-process
receiver (the one the tests use), sends a completion with a ~600-token prompt no node
has seen (24 output tokens), collects its trace and writes a Gantt chart of its spans, coloured by
service, to docs/trace.png (what docs/observability.md shows).

    python benchmarks/trace_picture.py [--out docs/trace.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus.server import free_port
from tandem.cli import build_parser
from tandem.launcher import Stack
from tests.otlp_receiver import CollectedSpan, OtlpReceiver

COLOURS = {"router": "#4c72b0", "prefill": "#dd8452", "decode": "#55a868", "kvcache": "#8172b3"}


def collect(receiver: OtlpReceiver, request_id: str, timeout: float = 30) -> list[CollectedSpan]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        roots = [s for s in spans if s.attributes.get("tandem.request_id") == request_id]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            if any(s.name == "decode.stream" for s in trace):
                time.sleep(1.0)  # stragglers (background uploads) of the same trace
                return [s for s in receiver.snapshot() if s.trace_id == roots[0].trace_id]
        time.sleep(0.2)
    raise RuntimeError(f"the trace of {request_id} did not arrive")


def draw(spans: list[CollectedSpan], out: Path) -> None:
    root = next(s for s in spans if not s.parent_id)
    spans = sorted(spans, key=lambda s: (s.start, -s.end))
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(spans) + 1.2))
    for row, s in enumerate(spans):
        start = (s.start - root.start) / 1e6
        width = max((s.end - s.start) / 1e6, 0.5)
        ax.barh(row, width, left=start, color=COLOURS.get(s.service, "#999999"))
        detail = ""
        for key in ("tandem.prompt_tokens", "tandem.bytes", "tandem.completion_tokens"):
            if key in s.attributes:
                detail = f"  {key.removeprefix('tandem.')}={s.attributes[key]}"
        ax.text(start + width + 5, row, f"{s.name}{detail}", va="center", fontsize=8)
        for name, t in s.events.items():
            ax.plot((t - root.start) / 1e6, row, "k|", markersize=12)
            ax.text((t - root.start) / 1e6, row - 0.45, name, fontsize=7, ha="center")
    ax.set_yticks(range(len(spans)))
    ax.set_yticklabels([s.service for s in spans], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the router received the request")
    ax.set_title(f"One request, one trace across services ({root.attributes['tandem.request_id']})")
    ax.set_xlim(0, (root.end - root.start) / 1e6 * 1.35)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/trace.png"))
    args = parser.parse_args()
    receiver = OtlpReceiver()
    receiver.start()
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    argv = ["up", "--prefill", "1", "--decode", "1", "--port", str(free_port())]
    argv += ["--transport", "ucx", "--kv-cache-mb", "128", "--otlp-endpoint", receiver.url]
    stack = Stack(build_parser().parse_args(argv))
    stack.out = open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    stack.start()
    try:
        stack.wait_ready()

        def complete(prompt: str) -> str:
            body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 24}
            body |= {"temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(
                stack.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                return str(json.loads(resp.read())["id"])

        complete("A warm-up request, unlike the one drawn.")
        # A prompt no node has seen: the disaggregated path, prefill node and KV transfer.
        request_id = complete(" ".join(["river", "stone", "cloud", "amber", "orbit"] * 120))
        spans = collect(receiver, request_id)
    finally:
        stack.stop()
        receiver.stop()
    draw(spans, args.out)
    print(f"{len(spans)} spans of {request_id} drawn to {args.out}")


if __name__ == "__main__":
    main()
