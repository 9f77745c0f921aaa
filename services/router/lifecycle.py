"""The life of one request, end to end (the state machine lives here and in the nodes).

1. **admitted** — the router validates the body (errors: 4xx, nothing queued), checks
   admission (at most `max_inflight` requests; past it 429 with Retry-After), subscribes to
   the request's token subject `tandem.tokens.<id>` and journals the request. If a decode
   node's pool holds all but a short tail of the prompt (KV-aware routing), the request goes
   straight to that node, which prefills the tail itself (step 3). Otherwise the router
   picks the decode node with the most free KV blocks per running sequence and publishes a
   PrefillJob on the JetStream work queue (Nats-Msg-Id = the attempt's handoff id:
   stored once; ids are explained in shared/bus/ids.py).
2. **prefilling** — a prefill node pulls the job (pull-based: the least busy node asks
   first), batches it with others, computes the KV and the first token, and publishes that
   token as delta 0. It asks the decode node to expect transfer `<id>` (NATS request; the
   node refuses when it lacks blocks and the prefill node tries the next one), sends the KV
   blocks over the data plane, and acks the job only after the decode node confirmed receipt.
   While it holds a job it sends in_progress every 2 s; a node that dies lets the job go to
   another after `ack_wait` (8 s). The prompt's cached prefix is loaded from the kvcache
   service first, and the new full blocks are stored there after.
3. **decoding** — the decode node imports the blocks into its paged pool and the sequence
   joins the running batch between two steps; every step publishes one delta per sequence
   (seq = index of the token).
4. **streaming** — the router reorders deltas by seq, drops duplicates, and streams text to
   the client (SSE) or collects it; the last delta carries the finish reason and usage.
5. **finished / failed / cancelled** — on finish the decode node frees the blocks. A client
   that disconnects makes the router publish Cancel: the prefill node skips the job, the
   decode node aborts the sequence and frees its blocks. A stalled stream ends with an error
   after `stall_timeout`; a request that never starts ends after `first_token_timeout`.
6. **failover** — when the node streaming a request leaves the registry (or the stream
   stalls, or a probe finds it dead), the router resubmits the job with the tokens it
   delivered (`output_ids`, a new attempt) straight to the decode node it picks
   (`Dispatch.resubmit`): that node loads their KV from kvcache (decode nodes store every
   block they fill, and their partial last block), recomputes only the rest, samples the
   next token exactly as the lost node would have, and streams on. Only if it refuses or
   does not answer does the job go through the prefill queue (to another decode node), where
   a prefill node does the same and hands the sequence over. The stream continues at the
   next seq and drops duplicates. At most 3 failovers per request
   (`services/router/failover.py`).
"""
