"""The life of one request, end to end (the state machine lives here and in the nodes).

1. **admitted** — the router validates the body (errors: 4xx, nothing queued), checks
   admission (at most `max_inflight` requests; past it 429 with Retry-After), picks the decode
   node with the most free KV blocks per running sequence, subscribes to the request's token
   subject `tandem.tokens.<id>`, journals the request, and publishes a PrefillJob on the
   JetStream work queue (Nats-Msg-Id = request id, so a retried publish is stored once).
2. **prefilling** — a prefill node pulls the job (pull-based: the least busy node asks
   first), batches it with others, computes the KV and the first token, and publishes that
   token as delta 0. It asks the decode node to expect transfer `<id>` (NATS request; the
   node refuses when it lacks blocks and the prefill node tries the next one), sends the KV
   blocks over the data plane, and acks the job only after the decode node confirmed receipt.
   A prefill node that dies before acking lets the job go to another after `ack_wait`.
3. **decoding** — the decode node imports the blocks into its paged pool and the sequence
   joins the running batch between two steps; every step publishes one delta per sequence
   (seq = index of the token).
4. **streaming** — the router reorders deltas by seq, drops duplicates, and streams text to
   the client (SSE) or collects it; the last delta carries the finish reason and usage.
5. **finished / failed / cancelled** — on finish the decode node frees the blocks. A client
   that disconnects makes the router publish Cancel: the prefill node skips the job, the
   decode node aborts the sequence and frees its blocks. A stalled stream ends with an error
   after `stall_timeout`; a request that never starts ends after `first_token_timeout`.
"""
