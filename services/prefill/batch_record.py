"""What a prefill node records of a batch: each job's queue-wait span (ended) and compute
span (started), and the batch's metrics once it is prefilled (worker.py)."""

from __future__ import annotations

import logging
import time

from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from shared.bus.workqueue import ReceivedJob
from shared.engine.prefill_steps import Prefilled
from shared.telemetry.metrics import NodeMetrics
from shared.telemetry.tracing import tracer

log = logging.getLogger("tandem.prefill")
TRACER = tracer("prefill")


def start_spans(
    jobs: list[ReceivedJob],
    contexts: dict[str, otel_context.Context],
    fetched: int,
    node_id: str,
    model: str,
) -> dict[str, Span]:
    """Each job's queue wait (from its JetStream timestamp to this fetch), ended; and
    its `prefill.compute` span, started."""
    for j in jobs:
        published = int(j.msg.metadata.timestamp.timestamp() * 1e9)
        wait = TRACER.start_span(
            "prefill.queue_wait",
            context=contexts[j.job.attempt_id],
            start_time=min(published, fetched),
            attributes={"tandem.node_id": node_id, "tandem.attempt": j.num_delivered},
        )
        wait.end(end_time=fetched)
    return {
        j.job.attempt_id: TRACER.start_span(
            "prefill.compute",
            context=contexts[j.job.attempt_id],
            attributes={
                "tandem.prompt_tokens": len(j.job.prompt_ids),
                "tandem.batch_size": len(jobs),
                "tandem.batch_tokens": sum(len(x.job.prompt_ids) for x in jobs),
                "tandem.node_id": node_id,
                "tandem.model": model,
            },
        )
        for j in jobs
    }


def count_batch(
    m: NodeMetrics,
    jobs: list[ReceivedJob],
    by_id: dict[str, ReceivedJob],
    results: list[Prefilled],
    fetched: int,
) -> None:
    """The batch's metrics, and how much of each resumed request was recomputed."""
    m.step_seconds.observe((time.time_ns() - fetched) / 1e9)
    m.batch_size.observe(len(jobs))
    m.tokens.inc(sum(len(j.job.prompt_ids) for j in jobs))
    m.prefix_lookup_tokens.inc(sum(out.num_prompt_tokens for out, _, _ in results))
    m.prefix_hit_tokens.inc(sum(out.num_cached_tokens for out, _, _ in results))
    for out, _, _ in results:
        resumed = by_id[out.request_id].job
        if resumed.output_ids:  # a failover or a resumed stream
            context = len(resumed.prompt_ids) + len(resumed.output_ids)
            recomputed = context - out.num_cached_tokens
            m.resume_recomputed.observe(recomputed)
            log.info(
                "resumed %s after %d tokens: %d of %d context tokens recomputed",
                out.request_id, len(resumed.output_ids), recomputed, context,
            )  # fmt: skip
